"""graphgear's CPU speed path: its own kernels and the passes that route a static
graph's products to them (or to MKL's packed GEMM) before Inductor compiles it.

* :mod:`.kernels`: the C++ kernels and the ops graphs call them by (below
  :mod:`graphgear.passes`: the post-grad decode attention pass puts one in graphs too);
* :mod:`.passes`: the rewrites of a static compile (``compilers.inductor.compile_static``,
  and max-autotune's inference graphs), each a
  :class:`~graphgear.passes.manager.GraphPass` run by a
  :class:`~graphgear.passes.manager.PassManager`: timed, dumped with
  ``debug.graph_dump``, counted in the graph's stats record and switchable by name in
  ``experimental_config.disabled_passes``;
* :mod:`.frozen`: the copies of frozen weights (packed, concatenated) those passes make,
  shared by a backend's graphs and gears.

This package's ``__init__`` imports nothing: :mod:`.kernels` sits below the passes,
:mod:`.passes` above them, and importing one must not import the other.
"""

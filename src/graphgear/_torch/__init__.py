"""Every private torch API graphgear relies on, one module per torch subsystem, each with
its version notes.

The rule: private torch APIs only under ``graphgear/_torch/``. Private means:
``torch._C._*``, ``torch._inductor``, ``torch._functorch``, ``torch._subclasses``,
``torch._guards``, ``torch._decomp``, ``torch._ops``, ``torch._dynamo``,
``torch._dispatch``, ``torch.fx.experimental._config``, ``torch.fx._graph_pickler``,
``torch.utils._pytree``, ``torch.utils._triton``, ``torch.distributed._*``, private
storage methods and the globals of Inductor's generated code; also the private
attributes of public objects (an ``OpOverload``'s ``_schema`` / ``_opname`` /
``_overloadname`` / ``_qualified_op_name``, ``fx.Node._erased``, AOTAutograd's
``_boxed_call`` protocol, ``make_fx``'s ``_allow_non_fake_inputs`` keyword). Other
modules import the wrappers and re-exports from these submodules instead of reaching
into those themselves (``tests/test_layout.py::test_private_torch_apis_only_in_torch_module``
enforces it), so a torch upgrade that moves something breaks here, visibly, in the
module of its subsystem, and nowhere else. No submodule imports a graphgear module
outside this package (bottom layer), and this package re-exports nothing: import each
name from its submodule (``from graphgear._torch.inductor import
inductor_compile_fx_inner``).

Submodules:

- :mod:`.storage`: storage internals (non-owning storages, weak references, use counts,
  version counters, torch's storage poison).
- :mod:`.fx`: fake tensors and modes, the tracing context, pytree, the Python
  dispatcher, ``make_fx`` and FX node internals, ``backed_size_oblivious``, the stable
  topological sort.
- :mod:`.ops`: op schemas and names, dispatch-key kernels, the fused RMSNorm
  decompositions.
- :mod:`.dynamo`: dim markings, frames and cache entries, the served code, module
  hooks, graph args, dynamo's compile lock.
- :mod:`.aot`: AOTAutograd (``aot_module_simplified``, input sources, partitioners, the
  boxed convention, forward returns, tangents).
- :mod:`.inductor`: Inductor's compiler, config, lowering, extern kernels, C++ kernel
  build, Triton, access to its generated code (read as code by
  ``graphgear.capture.program``).
- :mod:`.inductor_passes`: Inductor's decomposition table, FX passes and pattern
  matcher.
- :mod:`.serialize`: graph pickling, AOTAutograd's bundled entries, Inductor's output
  for disk and its load, the config digest, the precompile guard filter.
- :mod:`.isa`: Inductor's CPU vector ISA.
- :mod:`.toolchain`: Inductor's C++ compiler, the vector ISA it picks and its default
  cache folder, as ``graphgear env`` reports them.
- :mod:`.distributed`: functional collectives.

Public, and so used directly elsewhere: ``torch.compiler.reset`` (documented; in 2.13
it is ``import torch._dynamo; torch._dynamo.reset()``), ``torch.compiler.config``,
``torch.fx`` and ``torch.fx.experimental.proxy_tensor.make_fx`` /
``torch.fx.experimental.symbolic_shapes`` (not underscored). ``torch._dynamo.mark_dynamic``
is documented (dynamic-shapes guide) but lives in ``torch._dynamo``, so it is wrapped
too (:mod:`.dynamo`); no private name is allowed outside this package. ATen's
underscored ops (``aten._fused_rms_norm``) are public op names and used where needed.

Version notes: "checked on 2.13" means the name was imported and exercised by the test
suite on torch 2.13.0 (CPU build). The project claims 2.13 and 2.14 (pyproject), the
versions its core suite ran on; "2.11 to 2.14" in a note says the name is in those
releases' sources. Where an item could not be checked on other versions the note names
the torch code that uses the same API in 2.13, which is what keeps it stable in practice.

Tested on torch 2.13.0 (CPU build, CI) and 2.14.1 (CUDA build, core suite on the CPU,
``scripts/torch_matrix.sh``); the CUDA tests ran once on 2.11.0 (CUDA 13, a lent H200).
"""

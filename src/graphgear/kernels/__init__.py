"""graphgear's own CPU kernels: plain C++ built once by Inductor's own C++ toolchain
(its compiler, flags, vector ISA and cache folder) into built-in ``kernel`` functions
like Inductor's generated kernels, and called from Inductor's generated code as extern
kernels writing into buffers Inductor allocates (so the graph stays straight-line code
the CPU graph replays as kernel calls).

* :mod:`.small_gemm`: the product of 2 to 16 rows by a frozen weight (decode batches);
* :mod:`.small_linear`: the same for a weight that is not frozen, read as it lies, and
  one row by a weight too wide for Inductor's one-row decomposition;
* :mod:`.decode_attention`: one-query attention over a KV cache that reads only the
  keys its mask lets through.

Below the passes and the compilers: both import these, these import only
:mod:`graphgear._torch` (:mod:`.build`: the C++ they share and how they are built). Where a kernel cannot be built (no C++ compiler), :func:`build`
logs why once and returns None, and its users keep what they did before."""

from __future__ import annotations

from torch import fx

from . import decode_attention, small_gemm, small_linear
from .build import VECTOR_PRELUDE, build

__all__ = ["VECTOR_PRELUDE", "build", "calls_in", "decode_attention", "register_lowerings", "small_gemm", "small_linear"]


def register_lowerings() -> None:
    """Inductor's lowerings of graphgear's kernels and their ``extern_kernels`` entries
    (idempotent): before any Inductor compile, and before code loaded from the compile
    cache (which calls ``extern_kernels.graphgear_*``) runs."""
    small_gemm.register_lowering()
    small_linear.register_lowering()
    decode_attention.register_lowering()


def calls_in(gm: fx.GraphModule) -> int:
    """How many calls of graphgear's kernels (ops of the ``graphgear`` namespace) ``gm``
    makes: Python-level extern kernels, which Inductor's C++ wrapper cannot call."""
    return sum(1 for n in gm.graph.nodes
               if n.op == "call_function" and getattr(n.target, "namespace", None) == "graphgear")

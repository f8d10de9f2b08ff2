"""graphgear's own CPU kernels: plain C++ built once by Inductor's own C++ toolchain
(its compiler, flags, vector ISA and cache folder) into built-in ``kernel`` functions
like Inductor's generated kernels, and called from Inductor's generated code as extern
kernels writing into buffers Inductor allocates (so the graph stays straight-line code
the CPU graph replays as kernel calls).

* :mod:`.small_gemm_kernel`: ``graphgear::packed_linear``, the product of 2 to 16 rows
  by a frozen weight, packed (decode batches);
* :mod:`.small_linear_kernel`: ``graphgear::small_linear``, the same for a weight read as
  it lies (not frozen, or too large to copy), and one row by a weight too wide for
  Inductor's one-row decomposition;
* :mod:`.decode_attention_kernel`: ``graphgear::decode_attention``, one-query attention
  over a KV cache that reads only the keys its mask lets through.

Each is declared once by :func:`.build.extern_kernel` (its op, fake, lowering, extern
function and the CPU graph's direct call). Below the passes and the compilers: the
passes that put these ops in graphs (:mod:`graphgear.cpu.passes`,
:mod:`graphgear.passes.decode_attention`) import these, these import only
:mod:`graphgear._torch` and :mod:`graphgear.shapes`. Where a kernel cannot be built (no
C++ compiler), its ``kernel()`` logs why once and returns None, and its users keep what
they did before."""

from __future__ import annotations

from torch import fx

from . import decode_attention_kernel, small_gemm_kernel, small_linear_kernel
from .build import VECTOR_PRELUDE, ExternKernel, build, extern_kernel

__all__ = ["KERNELS", "VECTOR_PRELUDE", "ExternKernel", "build", "calls_in", "decode_attention_kernel",
           "extern_kernel", "register_lowerings", "small_gemm_kernel", "small_linear_kernel"]

#: every kernel graphs may call
KERNELS: tuple[ExternKernel, ...] = (small_gemm_kernel.PACKED_LINEAR, small_linear_kernel.SMALL_LINEAR,
                                     decode_attention_kernel.DECODE_ATTENTION)


def register_lowerings() -> None:
    """Inductor's lowerings of graphgear's kernels and their ``extern_kernels`` entries
    (idempotent): before any Inductor compile, and before code loaded from the compile
    cache (which calls ``extern_kernels.graphgear_*``) runs."""
    for k in KERNELS:
        k.register_lowering()


def calls_in(gm: fx.GraphModule) -> int:
    """How many calls of graphgear's kernels (ops of the ``graphgear`` namespace) ``gm``
    makes: Python-level extern kernels, which Inductor's C++ wrapper cannot call."""
    return sum(1 for n in gm.graph.nodes
               if n.op == "call_function" and getattr(n.target, "namespace", None) == "graphgear")

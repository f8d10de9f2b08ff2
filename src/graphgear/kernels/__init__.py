"""graphgear's own CPU kernels: plain C++ built once by Inductor's own C++ toolchain
(its compiler, flags, vector ISA and cache folder) into built-in ``kernel`` functions
like Inductor's generated kernels, and called from Inductor's generated code as extern
kernels writing into buffers Inductor allocates (so the graph stays straight-line code
the CPU graph replays as kernel calls).

* :mod:`.small_gemm`: the product of 2 to 16 rows by a frozen weight (decode batches);
* :mod:`.decode_attention`: one-query attention over a KV cache that reads only the
  keys its mask lets through.

Below the passes and the compilers: both import these, these import only
:mod:`graphgear._torch`. Where a kernel cannot be built (no C++ compiler), :func:`build`
logs why once and returns None, and its users keep what they did before."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from torch import fx

from .. import _torch

log = logging.getLogger(__name__)

__all__ = ["VECTOR_PRELUDE", "build", "calls_in"]

#: C++ shared by the kernels: the vector width of the ISA Inductor builds for (16 floats
#: with AVX-512, 8 with AVX/AVX2, 4 otherwise; ``VW``, and ``GG_VW`` for the
#: preprocessor) and GCC vector types of it. Inductor builds with ``-ffp-contract=off``
#: (its kernels match eager bit for bit); graphgear's kernels sum in their own order
#: anyway, so they let GCC fuse multiply-adds (measured, graphgear's product over the
#: small bench model's 17 products, 1 thread, same run: 8 rows 0.84x, 16 rows 0.69x).
VECTOR_PRELUDE = r"""
#pragma GCC optimize ("fp-contract=fast")
#include <cstdint>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#define GG_VW 16
#elif defined(__AVX__)
#define GG_VW 8
#else
#define GG_VW 4
#endif
constexpr int VW = GG_VW;
typedef float vec __attribute__((vector_size(VW * 4)));
typedef float uvec __attribute__((vector_size(VW * 4), aligned(4)));
static inline vec vload(const float* p) { return *reinterpret_cast<const uvec*>(p); }
static inline void vstore(float* p, vec v) { *reinterpret_cast<uvec*>(p) = v; }
"""


def build(what: str, argtypes: Sequence[str], source: str, instead: str) -> Callable[..., None] | None:
    """``source`` (C++ defining ``extern "C" void kernel(...)`` with ``argtypes``) built
    by :func:`graphgear._torch.inductor_load_cpp_kernel` into a built-in function, or
    None where it cannot be built here: then a warning names ``what`` could not be
    built, why, and what runs ``instead``."""
    try:
        return _torch.inductor_load_cpp_kernel(argtypes, source)
    except Exception as e:  # no compiler, or Inductor's build changed: the caller falls back
        log.warning("graphgear: %s could not be built (%s: %s); %s instead.", what, type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "", instead)
        return None


def calls_in(gm: fx.GraphModule) -> int:
    """How many calls of graphgear's kernels (ops of the ``graphgear`` namespace) ``gm``
    makes: Python-level extern kernels, which Inductor's C++ wrapper cannot call."""
    return sum(1 for n in gm.graph.nodes
               if n.op == "call_function" and getattr(n.target, "namespace", None) == "graphgear")

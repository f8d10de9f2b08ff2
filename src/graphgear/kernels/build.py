"""How graphgear's kernels are built: the C++ they share and Inductor's toolchain."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from .._torch import inductor as _torch_inductor

log = logging.getLogger(__name__)

__all__ = ["VECTOR_PRELUDE", "build", "product_direct"]

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
        return _torch_inductor.inductor_load_cpp_kernel(argtypes, source)
    except Exception as e:  # no compiler, or Inductor's build changed: the caller falls back
        log.warning("graphgear: %s could not be built (%s: %s); %s instead.", what, type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "", instead)
        return None



def product_direct(kernel: Callable[[], Callable[..., None] | None],
                   check: Callable[..., tuple[Any, ...]]) -> Callable[..., tuple[Any, tuple[Any, ...], None]]:
    """The ``graphgear_direct`` of an extern product ``fn(x, w, b=None, *, out)``: the
    CPU graph's kernel-call replay calls the built kernel (``kernel()``) itself with
    the arguments ``check(x, w, b, out)`` gives, checked once when its calls are made,
    no Python frame per replay."""
    def direct(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> tuple[Any, tuple[Any, ...], None]:
        out = (kwargs or {})["out"]
        x, w, *rest = args
        fn = kernel()
        assert fn is not None  # a graph that calls it was compiled with it
        return fn, check(x, w, rest[0] if rest else None, out), None

    return direct

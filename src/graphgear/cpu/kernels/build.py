"""How graphgear's kernels are built and declared: the C++ they share, Inductor's
toolchain, and :func:`extern_kernel`, the one declaration of a kernel as an op graphs call
(the custom op, its fake, Inductor's lowering, the extern function Inductor's generated
code calls and the direct call the CPU graph's replay makes)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..._torch import inductor as _torch_inductor

log = logging.getLogger(__name__)

__all__ = ["PRODUCT_ARGTYPES", "VECTOR_PRELUDE", "ExternKernel", "KernelFn", "build", "built_kernel",
           "extern_kernel"]

#: a built kernel: a built-in function of C arguments, returning nothing
KernelFn = Callable[..., None]

#: the C arguments of the products' kernels: ``kernel(x, w, b, y, M, K, N, has_bias, threads)``
PRODUCT_ARGTYPES = ("const float*", "const float*", "const float*", "float*",
                    "const int64_t", "const int64_t", "const int64_t", "const int64_t", "const int64_t")

#: C++ shared by the kernels: the vector width of the ISA Inductor builds for (16 floats
#: with AVX-512, 8 with AVX/AVX2, 4 otherwise; ``VW``, and ``GG_VW`` for the
#: preprocessor) and GCC vector types of it. Inductor builds with ``-ffp-contract=off``
#: (its kernels match eager bit for bit); graphgear's kernels sum in their own order
#: anyway, so they let GCC fuse multiply-adds, which is faster (benchmarks/RESULTS.md,
#: "bench_decode.py history").
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


def build(what: str, argtypes: Sequence[str], source: str, instead: str) -> KernelFn | None:
    """``source`` (C++ defining ``extern "C" void kernel(...)`` with ``argtypes``) built
    by :func:`graphgear._torch.inductor.inductor_load_cpp_kernel` into a built-in function, or
    None where it cannot be built here: then a warning names ``what`` could not be
    built, why, and what runs ``instead``."""
    try:
        return _torch_inductor.inductor_load_cpp_kernel(argtypes, source)
    except Exception as e:  # no compiler, or Inductor's build changed: the caller falls back
        log.warning("graphgear: %s could not be built (%s: %s); %s instead.", what, type(e).__name__,
                    str(e).splitlines()[0] if str(e) else "", instead)
        return None


def built_kernel(what: str, argtypes: Sequence[str], source: str, instead: str) -> Callable[[], KernelFn | None]:
    """``kernel()``: :func:`build` of these, once per process (``functools.cache``; its
    ``__wrapped__`` builds again), the kernel or None (logged once) where it cannot be
    built here."""
    return functools.cache(lambda: build(what, argtypes, source, instead))


@dataclasses.dataclass(frozen=True)
class ExternKernel:
    """One of graphgear's kernels as graphs call it (made by :func:`extern_kernel`).

    ``op``: the custom op ``graphgear::<name>`` (callable eagerly; ``torch.ops.graphgear.<name>``);
    ``out``: the extern function ``out(*tensors, **kwargs, out=buf)`` Inductor's generated
    code calls as ``extern_kernels.graphgear_<name>``, writing into a buffer Inductor
    allocates (its ``graphgear_direct`` gives the CPU graph's kernel-call replay the built
    kernel and its checked arguments, so a replay runs no Python frame per call)."""

    name: str
    op: Any
    out: Callable[..., torch.Tensor]
    out_size: Callable[..., list[Any]]
    call_kwargs: Callable[..., dict[str, Any]] | None = None

    def register_lowering(self) -> None:
        """Inductor's lowering of the op to the extern function (once per process)."""
        _torch_inductor.register_inductor_extern_out(getattr(torch.ops.graphgear, self.name).default, self.out,
                                            f"graphgear_{self.name}", self.out_size, self.call_kwargs)


def extern_kernel(name: str, output: Callable[..., torch.Tensor], *, kernel: Callable[[], KernelFn | None],
                  args: Callable[..., tuple[Any, ...]], out_size: Callable[..., list[Any]],
                  call_kwargs: Callable[..., dict[str, Any]] | None = None) -> ExternKernel:
    """Declare the op ``graphgear::<name>`` run by a built kernel.

    ``output(*op_args)``: the op's signature (annotated: the op's schema is inferred from
    it), returning the empty output tensor; it is the op's fake too. Tensor arguments
    come first, then scalars; an optional tensor is last among the tensors (a None
    tensor is left out of the extern call, as Inductor's lowering leaves it out).
    ``kernel()``: the built kernel or None where it cannot be built (looked up on each
    call, so a test may replace it). ``args(*tensors, **kwargs, out=buf)``: the kernel's
    C arguments, checked (a ValueError naming what was expected otherwise).
    ``out_size(*sizes, *scalars)`` and ``call_kwargs(*scalars)``: for Inductor's
    lowering (:func:`graphgear._torch.inductor.register_inductor_extern_out`); ``call_kwargs``
    also says which scalars the extern call takes as keywords (none without it)."""

    def out(*tensors: torch.Tensor, out: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        fn = kernel()
        if fn is None:
            raise RuntimeError(f"graphgear_{name}: the kernel is not built here (see the warning logged by "
                               "graphgear.cpu.kernels); recompile the model.")
        fn(*args(*tensors, out=out, **kwargs))
        return out

    def direct(a: tuple[Any, ...], kw: dict[str, Any] | None) -> tuple[Any, tuple[Any, ...], None]:
        rest = dict(kw or {})
        buf = rest.pop("out")
        fn = kernel()
        assert fn is not None  # a graph that calls it was compiled with it
        return fn, args(*a, out=buf, **rest), None

    out.graphgear_direct = direct  # type: ignore[attr-defined]  # read by capture/cpu_graph
    out.__name__ = out.__qualname__ = f"graphgear_{name}"

    def run(*op_args: Any) -> torch.Tensor:
        tensors = [a.contiguous() for a in op_args if isinstance(a, torch.Tensor)]
        scalars = [a for a in op_args if not isinstance(a, torch.Tensor) and a is not None]
        kwargs = call_kwargs(*scalars) if call_kwargs is not None else {}
        return out(*tensors, **kwargs, out=output(*op_args))

    run.__doc__ = output.__doc__
    op = torch.library.custom_op(f"graphgear::{name}", run, mutates_args=(),
                                 schema=torch.library.infer_schema(output, mutates_args=()))
    op.register_fake(output)
    return ExternKernel(name, op, out, out_size, call_kwargs)

"""graphgear's small-M matrix product for weights that are not frozen (decode batches 2
to 16 in max-autotune and plain reduce-overhead, and batch 1 where a weight is too wide
for Inductor's one-row decomposition).

Without ``frozen_parameter`` a weight may change between calls, so it cannot be packed
once (:mod:`.small_gemm` does that for frozen weights); ATen's ``addmm``/``mm`` (MKL
``sgemm``) then runs every decode product, and at a few rows it re-packs the weight
panel on each call, reading the weights at a fifth to a third of the one-row rate.
This kernel reads the weight as it lies (``[N, K]`` row-major, as ``nn.Linear`` holds
it): for a group of weight rows (3 with AVX/AVX2, 4 with AVX-512) and up to 4 input
rows at a time it keeps one vector of partial sums per (input row, weight row) in
registers while both stream along ``K``, and sums each vector once at the end. The
weight rows are read from memory once for every input row; later row groups read them
from the cache. Threads split the weight rows.

Measured side by side (2026-12-03, 1 thread, AMD EPYC with AVX2; the 17 products of
bench_decode's small Qwen2 step, 11.5 MB of weights; µs for all 17, ATen / this
kernel / :mod:`.small_gemm` on packed weights): 2 rows 1867 / 644 / 435, 4 rows 2467 /
689 / 570, 8 rows 2663 / 1018 / 950.

At one row 8 weight rows stream side by side. ATen's ``sgemv`` there reads at about
the rate of one thread whatever the thread count; the 15 products of bench_decode's
large model (126 MB, from DRAM; 2026-12-03, same run, ATen / this kernel / ``torch.sum``
over the same weights): 1 thread 10134 / 8527 / 8945 µs, 2 threads 9930 / 5438 / 6056.
(3 or 4 rows of 1 or 2 vectors each, 2 rows of 4: 3-10 % slower; a software prefetch
ahead of each stream: 25 % slower.)

Sums run along ``K`` in vector lanes, in another order than ATen's: results agree to
fp32 rounding, not bit for bit. Where the kernel cannot be built (no C++ compiler)
:func:`kernel` logs why once and returns None: products stay ATen's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .._torch.inductor import register_inductor_extern_out
from .build import VECTOR_PRELUDE, build, product_direct

__all__ = ["MAX_ROWS", "MIN_ROWS", "kernel", "register_lowering", "small_linear", "small_linear_out"]

#: rows served: decode batches above 1 (one row stays Inductor's fused loops where it
#: decomposes it: see :mod:`graphgear.compilers.small_linear`); past 16 rows ATen's
#: GEMM does well enough
MIN_ROWS = 2
MAX_ROWS = 16

_SOURCE = "#include <algorithm>\n" + VECTOR_PRELUDE + r"""
#if GG_VW == 16
constexpr int MR = 4, NR = 4;   // 16 sums + 4 weight vectors + 1 input vector of 32 registers
#elif GG_VW == 8
constexpr int MR = 4, NR = 3;   // 12 sums + 3 + 1 of 16
#else
constexpr int MR = 2, NR = 2;
#endif

static inline float hsum(vec v) {
    float s = 0.0f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
}

// y[0:M, n0:n0 + R] = x[0:M, :] @ w[n0:n0 + R, :].T (+ b), M <= MR
template <int M, int R>
static inline void tile(const float* x, int64_t K, const float* w, const float* b, float* y, int64_t N,
                        int64_t n0) {
    vec acc[M][R];
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) acc[m][r] = vec{};
    int64_t k = 0;
    for (; k + VW <= K; k += VW) {
        vec wv[R];
        for (int r = 0; r < R; r++) {
            wv[r] = vload(w + (n0 + r) * K + k);
            __builtin_prefetch(w + (n0 + r + R) * K + k + 64);
        }
        for (int m = 0; m < M; m++) {
            const vec xv = vload(x + m * K + k);
            for (int r = 0; r < R; r++) acc[m][r] += xv * wv[r];
        }
    }
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) {
            float s = hsum(acc[m][r]);
            for (int64_t j = k; j < K; j++) s += x[m * K + j] * w[(n0 + r) * K + j];
            y[m * N + n0 + r] = s + (b ? b[n0 + r] : 0.0f);
        }
}

template <int R>
static inline void column(const float* x, int64_t M, int64_t K, const float* w, const float* b, float* y,
                          int64_t N, int64_t n0) {
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const float* xs = x + m0 * K;
        float* ys = y + m0 * N;
        switch (M - m0 < MR ? M - m0 : MR) {
            case 1: tile<1, R>(xs, K, w, b, ys, N, n0); break;
            case 2: tile<(MR >= 2 ? 2 : 1), R>(xs, K, w, b, ys, N, n0); break;
            case 3: tile<(MR >= 3 ? 3 : 1), R>(xs, K, w, b, ys, N, n0); break;
            default: tile<MR, R>(xs, K, w, b, ys, N, n0); break;
        }
    }
}

// one row: R1 weight rows stream side by side, one vector of sums each (a decode step at
// batch 1 reads each weight once, from memory: as many streams as the prefetchers follow)
constexpr int R1 = 8;

template <int R>
static inline void one(const float* x, int64_t K, const float* w, const float* b, float* y, int64_t n0) {
    vec acc[R];
    for (int r = 0; r < R; r++) acc[r] = vec{};
    int64_t k = 0;
    for (; k + VW <= K; k += VW) {
        const vec xv = vload(x + k);
        for (int r = 0; r < R; r++) acc[r] += xv * vload(w + (n0 + r) * K + k);
    }
    for (int r = 0; r < R; r++) {
        float s = hsum(acc[r]);
        for (int64_t j = k; j < K; j++) s += x[j] * w[(n0 + r) * K + j];
        y[n0 + r] = s + (b ? b[n0 + r] : 0.0f);
    }
}

static void rows(const float* x, const float* w, const float* b, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t n_begin, int64_t n_end) {
    int64_t n = n_begin;
    if (M == 1) {
        for (; n + R1 <= n_end; n += R1) one<R1>(x, K, w, b, y, n);
        for (; n < n_end; n++) one<1>(x, K, w, b, y, n);
        return;
    }
    for (; n + NR <= n_end; n += NR) column<NR>(x, M, K, w, b, y, N, n);
    for (; n < n_end; n++) column<1>(x, M, K, w, b, y, N, n);
}

// threads: split the weight rows in groups of NR (R1 at one row)
extern "C" void kernel(const float* x, const float* w, const float* b, float* y, const int64_t M,
                       const int64_t K, const int64_t N, const int64_t has_bias, const int64_t threads) {
    const float* bias = has_bias ? b : nullptr;
#ifdef _OPENMP
    const int64_t unit = M == 1 ? R1 : NR;
    const int64_t groups = (N + unit - 1) / unit;
    const int64_t nt = threads < groups ? threads : groups;
    if (nt > 1 && K * N >= 65536) {
        #pragma omp parallel num_threads(nt)
        {
            const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
            rows(x, w, bias, y, M, K, N, std::min(N, groups * t / T * unit), std::min(N, groups * (t + 1) / T * unit));
        }
        return;
    }
#endif
    rows(x, w, bias, y, M, K, N, 0, N);
}
"""
_ARGTYPES = ("const float*", "const float*", "const float*", "float*",
             "const int64_t", "const int64_t", "const int64_t", "const int64_t", "const int64_t")


@functools.cache
def kernel() -> Callable[..., None] | None:
    """The built kernel ``kernel(x, w, b, y, M, K, N, has_bias, threads)``, or None
    (logged once) where it cannot be built here."""
    return build("its small-batch product for weights that are not frozen", _ARGTYPES, _SOURCE,
                 f"products of {MIN_ROWS} to {MAX_ROWS} rows stay ATen's")


def _args(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor) -> tuple[Any, ...]:
    if not (x.dim() == 2 and w.dim() == 2 and out.dim() == 2 and x.is_contiguous() and w.is_contiguous()
            and out.is_contiguous() and x.dtype == w.dtype == out.dtype == torch.float32
            and x.device.type == w.device.type == out.device.type == "cpu"
            and w.shape[1] == x.shape[1] and tuple(out.shape) == (x.shape[0], w.shape[0])
            and (b is None or (b.dim() == 1 and b.is_contiguous() and b.dtype == torch.float32
                               and b.shape[0] == w.shape[0]))):
        raise ValueError(
            f"graphgear_small_linear: x {tuple(x.shape)} {x.dtype}, weight {tuple(w.shape)} {w.dtype}, "
            f"bias {None if b is None else tuple(b.shape)}, out {tuple(out.shape)}: expected contiguous "
            f"fp32 CPU tensors x [M, K], weight [N, K], bias [N] or None, out [M, N].")
    return (x, w, w if b is None else b, out, x.shape[0], x.shape[1], w.shape[0], int(b is not None),
            torch.get_num_threads())


def small_linear_out(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *,
                     out: torch.Tensor) -> torch.Tensor:
    """``out = x @ w.T (+ b)``: the extern kernel Inductor's generated code calls."""
    fn = kernel()
    if fn is None:
        raise RuntimeError("graphgear_small_linear: the kernel is not built here (see the warning "
                           "logged by graphgear.kernels.small_linear); recompile the model.")
    fn(*_args(x, w, b, out))
    return out


# read by capture/cpu_graph (kernel and _args looked up when called, as in small_linear_out)
small_linear_out.graphgear_direct = product_direct(lambda: kernel(), lambda *a: _args(*a))  # type: ignore[attr-defined]


@torch.library.custom_op("graphgear::small_linear", mutates_args=())
def small_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T (+ b)`` (``[M, N]``) for ``w`` ``[N, K]`` as ``nn.Linear`` holds it;
    Inductor lowers it to the extern kernel."""
    return small_linear_out(x.contiguous(), w.contiguous(), None if b is None else b.contiguous(),
                            out=x.new_empty((x.shape[0], w.shape[0])))


@small_linear.register_fake
def _small_linear_fake(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def register_lowering() -> None:
    """Inductor's lowering of ``graphgear::small_linear`` (once per process)."""
    register_inductor_extern_out(
        torch.ops.graphgear.small_linear.default, small_linear_out, "graphgear_small_linear",
        lambda x, w, *_rest: [x[0], w[0]])

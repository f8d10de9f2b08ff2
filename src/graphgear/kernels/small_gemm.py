"""graphgear's own small-M matrix product for frozen CPU weights (decode batches 2 to 16).

A decode step multiplies a few rows (the batch) by every weight matrix; the step is
bound by reading the weights. MKL's packed GEMM (:mod:`.mkl_pack`) reads them at two
thirds of the one-row rate at 8 rows and needs a call into ATen per product (so the
graph runs through Inductor's C++ wrapper, and the CPU graph replays the wrapper). This
kernel holds each weight packed in panels of 32 columns (``[ceil(N / 32), K, 32]``,
zero-padded) and, per panel, keeps up to 8 rows x 32 columns of sums in vector
registers while it streams the panel once, prefetching ahead: at 2 to 8 rows it reads
the weights about as fast as at one. It is plain C++ with GCC vector types (16 floats
a vector with AVX-512, 8 with AVX/AVX2, 4 otherwise), built once by Inductor's own C++
toolchain into a built-in ``kernel`` like Inductor's generated kernels, and called
from the generated code as ``extern_kernels.graphgear_packed_linear(x, wp, b,
out=buf)``: a buffer Inductor allocates, so the graph stays straight-line code and the
CPU graph replays it as kernel calls (``capture/cpu_graph._Program``) at every batch.

Measured side by side (2026-12-02, 1 thread, the 17 products of bench_decode's small
Qwen2 step, 11.6 MB of weights; µs for all 17, MKL packed / this kernel): 1 row 917 /
581, 2 rows 890 / 640, 4 rows 969 / 647, 8 rows 1164 / 833, 16 rows 1722 / 1519. Since
it lets GCC fuse multiply-adds (:data:`graphgear.kernels.VECTOR_PRELUDE`; 2026-12-02,
same run, fused / not): 2 rows 661 / 675, 8 rows 721 / 858, 16 rows 1333 / 1931 µs.

In the served step of that model (same run, graphgear's / MKL's products), 1 thread:
batch 2 0.87 and 0.67, batch 4 0.65 and 0.57, batch 8 0.70 and 0.73; 2 threads (the
panels split over the threads): batch 2 0.76, batch 8 0.81; the large model (hidden 1024,
128 MB of weights) batch 8 0.84. At one row it was no faster than Inductor's fused
loops (0.98, 1.01), so one-row products stay theirs; those whose weight is too wide
for Inductor's one-row decomposition (which would be ATen's ``sgemv``) went here until
2026-12-03 and now go to :mod:`.small_linear`, which streams the frozen weight as it
lies faster than this kernel streams its packed copy, and needs no copy
(:func:`graphgear.compilers.mkl_pack.pack_frozen_small`).

Summation order differs from MKL's and ATen's (per output, over ``K`` in order, in
fp32): results agree to fp32 rounding, not bit for bit. Where the kernel cannot be
built (no C++ compiler), :func:`kernel` logs why once and returns None: the products
then go to MKL as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .._torch.inductor import register_inductor_extern_out
from .build import VECTOR_PRELUDE, build, product_direct

__all__ = ["MAX_ROWS", "MIN_ROWS", "PANEL", "kernel", "pack_bias", "pack_weight", "packed_linear",
           "packed_linear_out", "register_lowering"]

#: rows served by this kernel: decode batches above 1 (one row stays Inductor's fused
#: loops, which fuse with their neighbours, but for weights too wide for them); past 16
#: rows MKL's packed GEMM catches up
MIN_ROWS = 2
MAX_ROWS = 16
#: panel width in floats: the packed weight's layout, fixed for every vector ISA
PANEL = 32

_SOURCE = VECTOR_PRELUDE + r"""
constexpr int NB = 32;        // panel width: the packing's layout
constexpr int NV = NB / VW;   // vectors per panel row
constexpr int MB = 16 / NV;   // rows per block: 16 vector accumulators

template <int MM>
static void rows(const float* x, int64_t K, const float* wp, const float* b, float* y,
                 int64_t N, int64_t p_begin, int64_t p_end) {
    for (int64_t p = p_begin; p < p_end; p++) {
        const float* w = wp + p * K * NB;
        vec acc[MM][NV];
        for (int v = 0; v < NV; v++) {
            vec bv = b ? vload(b + p * NB + v * VW) : vec{};
            for (int m = 0; m < MM; m++) acc[m][v] = bv;
        }
        for (int64_t k = 0; k < K; k++) {
            const float* wk = w + k * NB;
            __builtin_prefetch(wk + 16 * NB);
            __builtin_prefetch(wk + 16 * NB + 16);
            vec wv[NV];
            for (int v = 0; v < NV; v++) wv[v] = vload(wk + v * VW);
            #pragma GCC unroll 8
            for (int m = 0; m < MM; m++) {
                const float xv = x[m * K + k];
                for (int v = 0; v < NV; v++) acc[m][v] += xv * wv[v];
            }
        }
        const int64_t n0 = p * NB, valid = N - n0 < NB ? N - n0 : NB;
        for (int m = 0; m < MM; m++) {
            float* row = y + m * N + n0;
            if (valid == NB) {
                for (int v = 0; v < NV; v++) vstore(row + v * VW, acc[m][v]);
            } else {
                float t[NB];
                for (int v = 0; v < NV; v++) vstore(t + v * VW, acc[m][v]);
                for (int64_t j = 0; j < valid; j++) row[j] = t[j];
            }
        }
    }
}

#define GG_ROWS(R) case R: if constexpr (MB >= R) { rows<(MB >= R ? R : 1)>(xs, K, wp, bias, ys, N, p0, p1); } break;

static void panel_range(const float* x, const float* wp, const float* bias, float* y, int64_t M, int64_t K,
                        int64_t N, int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const float* xs = x + m0 * K;
        float* ys = y + m0 * N;
        switch (M - m0 < MB ? M - m0 : MB) {
            GG_ROWS(1) GG_ROWS(2) GG_ROWS(3) GG_ROWS(4) GG_ROWS(5) GG_ROWS(6) GG_ROWS(7)
            default: if constexpr (MB >= 8) { rows<(MB >= 8 ? 8 : 1)>(xs, K, wp, bias, ys, N, p0, p1); } break;
        }
    }
}

// threads: split the panels (each thread streams its own part of the weight)
extern "C" void kernel(const float* x, const float* wp, const float* b, float* y, const int64_t M,
                       const int64_t K, const int64_t N, const int64_t has_bias, const int64_t threads) {
    const float* bias = has_bias ? b : nullptr;
    const int64_t panels = (N + NB - 1) / NB;
    int64_t nt = threads < panels ? threads : panels;
#ifdef _OPENMP
    if (nt > 1 && K * NB * panels >= 16384) {
        #pragma omp parallel num_threads(nt)
        {
            const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
            panel_range(x, wp, bias, y, M, K, N, panels * t / T, panels * (t + 1) / T);
        }
        return;
    }
#endif
    panel_range(x, wp, bias, y, M, K, N, 0, panels);
}
"""
_ARGTYPES = ("const float*", "const float*", "const float*", "float*",
             "const int64_t", "const int64_t", "const int64_t", "const int64_t", "const int64_t")


@functools.cache
def kernel() -> Callable[..., None] | None:
    """The built kernel ``kernel(x, wp, b, y, M, K, N, has_bias, threads)``, or None (logged once)
    where it cannot be built here."""
    return build("its small-batch matrix product", _ARGTYPES, _SOURCE,
                 f"frozen products of {MIN_ROWS} to {MAX_ROWS} rows use MKL's packed GEMM")


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """``w`` (``[N, K]`` fp32) in the kernel's layout: ``[ceil(N / 32), K, 32]``, the
    columns past ``N`` zero."""
    n, k = w.shape
    padded = -(-n // PANEL) * PANEL
    full = torch.zeros(padded, k, dtype=torch.float32)
    full[:n] = w
    return full.view(padded // PANEL, PANEL, k).transpose(1, 2).contiguous()


def pack_bias(b: torch.Tensor) -> torch.Tensor:
    """``b`` (``[N]`` fp32) zero-padded to whole panels, as the kernel reads it."""
    padded = -(-b.shape[0] // PANEL) * PANEL
    out = torch.zeros(padded, dtype=torch.float32)
    out[: b.shape[0]] = b
    return out


def _args(x: torch.Tensor, wp: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor) -> tuple[Any, ...]:
    if not (x.dim() == 2 and x.is_contiguous() and out.is_contiguous() and out.dim() == 2
            and x.dtype == wp.dtype == out.dtype == torch.float32 and wp.dim() == 3
            and wp.shape[1] == x.shape[1] and wp.shape[2] == PANEL and out.shape[0] == x.shape[0]
            and 0 < out.shape[1] <= wp.shape[0] * PANEL and wp.is_contiguous()
            and (b is None or (b.is_contiguous() and b.shape[0] == wp.shape[0] * PANEL))):
        raise ValueError(
            f"graphgear_packed_linear: x {tuple(x.shape)} {x.dtype}, packed weight {tuple(wp.shape)}, "
            f"bias {None if b is None else tuple(b.shape)}, out {tuple(out.shape)}: expected contiguous "
            f"fp32 x [M, K], a weight packed by graphgear.kernels.small_gemm.pack_weight ([P, K, "
            f"{PANEL}]), a bias padded by pack_bias, and out [M, N] with N <= P * {PANEL}.")
    return (x, wp, wp if b is None else b, out, x.shape[0], x.shape[1], out.shape[1], int(b is not None),
            torch.get_num_threads())


def packed_linear_out(x: torch.Tensor, wp: torch.Tensor, b: torch.Tensor | None = None, *,
                      out: torch.Tensor) -> torch.Tensor:
    """``out = x @ W.T (+ b)`` with ``W`` packed by :func:`pack_weight`: the extern
    kernel Inductor's generated code calls."""
    fn = kernel()
    if fn is None:
        raise RuntimeError("graphgear_packed_linear: the kernel is not built here (see the warning "
                           "logged by graphgear.kernels.small_gemm); recompile the model.")
    fn(*_args(x, wp, b, out))
    return out


# read by capture/cpu_graph (kernel and _args looked up when called, as in packed_linear_out)
packed_linear_out.graphgear_direct = product_direct(lambda: kernel(), lambda *a: _args(*a))  # type: ignore[attr-defined]


@torch.library.custom_op("graphgear::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, wp: torch.Tensor, b: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x @ W.T (+ b)`` (``[M, n]``) with ``W`` packed by :func:`pack_weight` and ``b``
    by :func:`pack_bias`; Inductor lowers it to the extern kernel."""
    return packed_linear_out(x.contiguous(), wp, b, out=x.new_empty((x.shape[0], n)))


@packed_linear.register_fake
def _packed_linear_fake(x: torch.Tensor, wp: torch.Tensor, b: torch.Tensor | None, n: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], n))


def register_lowering() -> None:
    """Inductor's lowering of ``graphgear::packed_linear`` (once per process)."""
    register_inductor_extern_out(
        torch.ops.graphgear.packed_linear.default, packed_linear_out, "graphgear_packed_linear",
        lambda x, *_sizes_and_n: [x[0], _sizes_and_n[-1]])

"""graphgear's one-query attention for CPU decode steps: reads only the keys the mask
lets through.

A decode step's attention has one query position and a KV cache of ``L`` positions.
transformers' ``StaticCache`` (and any fixed-size cache a CPU graph replays) holds
``max_cache_len`` positions, most of them not written yet; the mask says which count.
ATen's flash kernel, its written-out form (:mod:`graphgear.passes.decode_attention`)
and torch.compile's code read every position, masked or not. This kernel first reads
the mask row (``L`` bytes), then reads the key and value rows of the positions it lets
through, once per key/value head for all the query heads that share it
(grouped-query attention stays grouped: query head ``h`` reads key/value head
``h // (H / KV)``, as ``repeat_kv`` orders them). Scores are dot products vectorised
over the head dim (GCC vector types of the ISA Inductor builds for), the softmax is
max-shifted and normalised once at the end. Work is split over ``(batch, key/value
head)`` with OpenMP over ``torch.get_num_threads()`` (baked into the kernel calls at
capture, like Inductor's own ``num_threads``).

Semantics are SDPA's for one query: a boolean mask keeps ``True``; a float mask is
added to the scores (its ``-inf`` entries are the ones skipped; finite values, however
negative, are read and added); no mask keeps every position. A row with no position
left gives zeros (as ATen's flash kernel), not NaN. Float32 only (the callers keep
other dtypes on their own paths). Summation order differs from ATen's: results agree
to fp32 rounding, not bit for bit.

Measured: see :data:`graphgear.passes.decode_attention.MAX_MACS` and the README.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from .._torch.inductor import register_inductor_extern_out
from ..shapes import known_equal
from .build import VECTOR_PRELUDE, build

__all__ = ["decode_attention", "decode_attention_out", "default_scale", "kernel", "mask_fits", "register_lowering"]

_SOURCE = VECTOR_PRELUDE + r"""
#include <cmath>
#include <limits>
#include <vector>

// the sum of a vector's lanes (a shuffle tree)
static inline float hsum(vec a) {
#if GG_VW == 16
    typedef int32_t ivec __attribute__((vector_size(64)));
    a += __builtin_shuffle(a, ivec{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    a += __builtin_shuffle(a, ivec{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    a += __builtin_shuffle(a, ivec{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    a += __builtin_shuffle(a, ivec{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#elif GG_VW == 8
    typedef int32_t ivec __attribute__((vector_size(32)));
    a += __builtin_shuffle(a, ivec{4, 5, 6, 7, 0, 1, 2, 3});
    a += __builtin_shuffle(a, ivec{2, 3, 0, 1, 6, 7, 4, 5});
    a += __builtin_shuffle(a, ivec{1, 0, 3, 2, 5, 4, 7, 6});
#else
    typedef int32_t ivec __attribute__((vector_size(16)));
    a += __builtin_shuffle(a, ivec{2, 3, 0, 1});
    a += __builtin_shuffle(a, ivec{1, 0, 3, 2});
#endif
    return a[0];
}

// exp of each lane (Cephes' expf: a degree-6 polynomial on x - k ln 2, scaled by 2^k;
// about 1 ulp); below -87.3 (and -inf) it gives 0
static inline vec vexp(vec x) {
    typedef int32_t ivec __attribute__((vector_size(VW * 4)));
    const vec lo = vec{} - 87.33654f;
    const vec xc = x < lo ? lo : x;
    const vec magic = vec{} + 12582912.f;
    const vec kf = (xc * 1.44269504088896341f + magic) - magic;
    const vec r = xc - kf * 0.693359375f + kf * 2.12194440e-4f;
    vec p = vec{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const vec y = p * r * r + r + 1.f;
    const ivec bits = (__builtin_convertvector(kf, ivec) + 127) << 23;
    vec scale; __builtin_memcpy(&scale, &bits, sizeof(scale));
    const vec out = y * scale;
    return x < lo ? vec{} : out;
}

constexpr int CH = 4;  // vectors of the head dim summed in registers at a time

// one (batch, key/value head): the G query heads of the group share its key and value
// rows; only the positions some head of the group may attend are read. work holds L
// indices and G x L scores (the caller's, one per thread)
static void group(const float* q, const float* k, const float* v, const uint8_t* mask, int64_t kind,
                  int64_t mstep, float* out, int64_t G, int64_t L, int64_t D, float scale, float* work) {
    const float NEG = -std::numeric_limits<float>::infinity();
    const float* mf = reinterpret_cast<const float*>(mask);
    const int64_t heads_masked = mstep ? G : 1;
    int32_t* idx = reinterpret_cast<int32_t*>(work);
    int64_t n = 0;
    for (int64_t t = 0; t < L; t++) {
        bool keep = kind == 0;
        for (int64_t g = 0; !keep && g < heads_masked; g++)
            keep = kind == 1 ? mask[g * mstep + t] != 0 : mf[g * mstep + t] != NEG;
        if (keep) idx[n++] = static_cast<int32_t>(t);
    }
    float* s = work + L;  // [G][n]
    const int64_t DV = D / VW * VW;
    // scores: each key row read once for the group's heads
    for (int64_t j = 0; j < n; j++) {
        const int64_t t = idx[j];
        const float* kt = k + t * D;
        if (j + 2 < n) __builtin_prefetch(k + idx[j + 2] * D);
        for (int64_t g = 0; g < G; g++) {
            const float* qg = q + g * D;
            vec a{};
            for (int64_t d = 0; d < DV; d += VW) a += vload(qg + d) * vload(kt + d);
            float dot = hsum(a);
            for (int64_t d = DV; d < D; d++) dot += qg[d] * kt[d];
            float sc = dot * scale;
            if (kind == 1) { if (!mask[g * mstep + t]) sc = NEG; }
            else if (kind == 2) sc += mf[g * mstep + t];
            s[g * n + j] = sc;
        }
    }
    // softmax per head, normalised here; then the weighted sum of the value rows, CH
    // vectors of the head dim at a time in registers
    for (int64_t g = 0; g < G; g++) {
        float* sg = s + g * n;
        float mx = NEG;
        for (int64_t j = 0; j < n; j++) mx = sg[j] > mx ? sg[j] : mx;
        float sum = 0.f;
        if (mx == NEG) {
            for (int64_t j = 0; j < n; j++) sg[j] = 0.f;
        } else {
            int64_t j = 0;
            vec vs{};
            for (; j + VW <= n; j += VW) {
                const vec e = vexp(vload(sg + j) - mx);
                vstore(sg + j, e);
                vs += e;
            }
            sum = hsum(vs);
            for (; j < n; j++) {
                const float e = std::exp(sg[j] - mx);
                sg[j] = e;
                sum += e;
            }
        }
        const float r = sum > 0.f ? 1.f / sum : 0.f;  // no position left: zeros
        for (int64_t j = 0; j < n; j++) sg[j] *= r;
        float* og = out + g * D;
        int64_t d0 = 0;
        for (; d0 + CH * VW <= DV; d0 += CH * VW) {
            vec acc[CH] = {};
            for (int64_t j = 0; j < n; j++) {
                const float* vt = v + idx[j] * D + d0;
                const float p = sg[j];
                #pragma GCC unroll 4
                for (int c = 0; c < CH; c++) acc[c] += p * vload(vt + c * VW);
            }
            #pragma GCC unroll 4
            for (int c = 0; c < CH; c++) vstore(og + d0 + c * VW, acc[c]);
        }
        for (; d0 < DV; d0 += VW) {
            vec acc{};
            for (int64_t j = 0; j < n; j++) acc += sg[j] * vload(v + idx[j] * D + d0);
            vstore(og + d0, acc);
        }
        for (int64_t d = DV; d < D; d++) {
            float acc = 0.f;
            for (int64_t j = 0; j < n; j++) acc += sg[j] * v[idx[j] * D + d];
            og[d] = acc;
        }
    }
}

// q, out [B, H, 1, D]; k, v [B, KV, L, D]; mask [MB, MH, 1, L] (MB in {1, B}, MH in {1, H});
// kind 0 none, 1 bool, 2 float added to the scores
extern "C" void kernel(const float* q, const float* k, const float* v, const uint8_t* mask, float* out,
                       const int64_t B, const int64_t H, const int64_t KV, const int64_t L, const int64_t D,
                       const int64_t MB, const int64_t MH, const int64_t kind, const float scale,
                       const int64_t threads) {
    const int64_t G = H / KV, items = B * KV;
    const int64_t mstep = MH == 1 ? 0 : L;
    const int64_t melt = kind == 2 ? 4 : 1;
    const int64_t per = L + G * L;  // floats of work per thread
    auto one = [&](int64_t i, float* work) {
        const int64_t b = i / KV, h = i % KV;
        const int64_t m0 = ((MB == 1 ? 0 : b) * MH + (MH == 1 ? 0 : h * G)) * L;
        group(q + (b * H + h * G) * D, k + i * L * D, v + i * L * D, mask + m0 * melt, kind, mstep,
              out + (b * H + h * G) * D, G, L, D, scale, work);
    };
#ifdef _OPENMP
    const int64_t nt = threads < items ? threads : items;
    if (nt > 1 && items * L * D >= 16384) {
        std::vector<float> work(per * nt);
        #pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t i = 0; i < items; i++) one(i, work.data() + per * omp_get_thread_num());
        return;
    }
#endif
    std::vector<float> work(per);
    for (int64_t i = 0; i < items; i++) one(i, work.data());
}
"""
_ARGTYPES = ("const float*", "const float*", "const float*", "const uint8_t*", "float*",
             "const int64_t", "const int64_t", "const int64_t", "const int64_t", "const int64_t",
             "const int64_t", "const int64_t", "const int64_t", "const float", "const int64_t")


@functools.cache
def kernel() -> Callable[..., None] | None:
    """The built kernel (see ``_SOURCE`` for its arguments), or None (logged once) where
    it cannot be built here."""
    return build("its decode attention kernel", _ARGTYPES, _SOURCE,
                 "one-query CPU attention runs as generated code (or ATen's flash kernel)")


def mask_fits(mask: Any, batch: Any, heads: Any, length: Any) -> bool:
    """Whether a mask of this (fake or real) tensor's shape and dtype is one the kernel
    reads: None, or ``[1 or B, 1 or H, 1, L]`` bool or float32. Sizes may be symbolic:
    compared without adding guards."""
    if mask is None:
        return True
    if not (isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.dtype in (torch.bool, torch.float32)):
        return False
    b, h, one, n = mask.shape
    return ((known_equal(b, 1) or known_equal(b, batch)) and (known_equal(h, 1) or known_equal(h, heads))
            and known_equal(one, 1) and known_equal(n, length))


def _args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          out: torch.Tensor) -> tuple[Any, ...]:
    ok = (q.dim() == 4 and k.dim() == 4 and q.shape[2] == 1 and k.shape == v.shape and out.shape == q.shape
          and q.dtype == k.dtype == v.dtype == out.dtype == torch.float32
          and q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3] and k.shape[1] > 0
          and q.shape[1] % k.shape[1] == 0
          and all(t.is_contiguous() and t.device.type == "cpu" for t in (q, k, v, out))
          and mask_fits(mask, q.shape[0], q.shape[1], k.shape[2])
          and (mask is None or (mask.is_contiguous() and mask.device.type == "cpu")))
    if not ok:
        m = None if mask is None else (tuple(mask.shape), mask.dtype)
        raise ValueError(
            f"graphgear_decode_attention: query {tuple(q.shape)} {q.dtype}, key {tuple(k.shape)} {k.dtype}, "
            f"value {tuple(v.shape)} {v.dtype}, mask {m}, out {tuple(out.shape)}: expected contiguous float32 "
            f"CPU tensors, query and out [B, H, 1, D], key and value [B, KV, L, D] with H a multiple of KV, "
            f"and a mask None or contiguous [1 or B, 1 or H, 1, L], bool or float32.")
    b, h, _, d = q.shape
    kv, length = k.shape[1], k.shape[2]
    kind = 0 if mask is None else (1 if mask.dtype == torch.bool else 2)
    mb, mh = (1, 1) if mask is None else (mask.shape[0], mask.shape[1])
    return (q, k, v, q if mask is None else mask, out, b, h, kv, length, d, mb, mh, kind, float(scale),
            torch.get_num_threads())


def decode_attention_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                         *, scale: float, out: torch.Tensor) -> torch.Tensor:
    """The attention of the one query of ``q`` into ``out``: the extern kernel
    Inductor's generated code calls."""
    fn = kernel()
    if fn is None:
        raise RuntimeError("graphgear_decode_attention: the kernel is not built here (see the warning logged "
                           "by graphgear.kernels); recompile the model.")
    fn(*_args(q, k, v, mask, scale, out))
    return out


def _direct(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> tuple[Any, tuple[Any, ...], None]:
    """The CPU graph's kernel-call replay calls the built kernel itself: checked once
    here when its calls are made, no Python frame per replay."""
    kw = dict(kwargs or {})
    out, scale = kw.pop("out"), kw.pop("scale")
    q, k, v, *rest = args
    fn = kernel()
    assert fn is not None  # a graph that calls it was compiled with it
    return fn, _args(q, k, v, rest[0] if rest else None, scale, out), None


decode_attention_out.graphgear_direct = _direct  # type: ignore[attr-defined]  # read by capture/cpu_graph


@torch.library.custom_op("graphgear::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """SDPA of ``q`` (``[B, H, 1, D]``) over ``k``, ``v`` (``[B, KV, L, D]``) with an
    optional mask (``[1 or B, 1 or H, 1, L]``, bool or float), skipping the positions
    it masks out; ``[B, H, 1, D]`` float32. Inductor lowers it to the extern kernel."""
    return decode_attention_out(q.contiguous(), k.contiguous(), v.contiguous(),
                                None if mask is None else mask.contiguous(), scale=scale,
                                out=q.new_empty(q.shape))


@decode_attention.register_fake
def _decode_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                           scale: float) -> torch.Tensor:
    return q.new_empty(q.shape)


def register_lowering() -> None:
    """Inductor's lowering of ``graphgear::decode_attention`` (once per process)."""
    register_inductor_extern_out(
        torch.ops.graphgear.decode_attention.default, decode_attention_out, "graphgear_decode_attention",
        lambda q, *_rest: list(q), lambda scale: {"scale": scale})


def default_scale(head_dim: int) -> float:
    """SDPA's scale where the caller gives none: ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim)

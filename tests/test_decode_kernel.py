"""graphgear's one-query attention kernel (``kernels/decode_attention``): against a
reference on odd shapes and every mask form, that it never reads the positions its mask
drops, over several threads, its misuse, where it cannot be built, and served
transformers decoders that call it (checked against eager: logits and the KV cache)."""

from __future__ import annotations

import gc

import pytest
import torch

import graphgear
import graphgear.cpu.kernels.decode_attention_kernel as attention_kernel
from graphgear.capture import CaptureEngine
from tests.helpers import assert_close, each_thread_count, ops_compiled, unbuildable_kernel
from tests.helpers import make_backend as _ro
from tests.models import hf_qwen2_pair

pytestmark = pytest.mark.inductor

NEG = float("-inf")


def _built() -> None:
    assert attention_kernel.kernel() is not None, "graphgear's decode attention kernel did not build here"


def _reference(q, k, v, mask, scale):  # type: ignore[no-untyped-def]
    """Softmax attention written plainly, in float64; a row with no key left is zeros."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, NEG) if mask.dtype == torch.bool else s + mask.double()
    mx = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(mx == NEG, torch.zeros_like(mx), mx))
    den = e.sum(-1, keepdim=True)
    return ((e @ vv) / torch.where(den == 0, torch.ones_like(den), den)).float()


def _masks(b: int, h: int, length: int) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(b * 100 + h * 10 + length)
    keep = torch.rand(b, 1, 1, length, generator=g) > 0.4
    keep[0, ..., 0] = True
    return {
        "none": None,
        "bool": keep,
        "bool-broadcast-batch": torch.rand(1, 1, 1, length, generator=g) > 0.5,
        "bool-per-head": torch.rand(b, h, 1, length, generator=g) > 0.5,
        "float": torch.randn(b, 1, 1, length, generator=g),
        "float-inf-per-head": torch.where(torch.rand(1, h, 1, length, generator=g) > 0.5, 0.0, NEG),
        "all-masked": torch.zeros(b, 1, 1, length, dtype=torch.bool),
    }


@pytest.mark.parametrize("shape", [(1, 4, 2, 64, 64), (3, 6, 3, 17, 20), (2, 8, 8, 5, 7), (1, 2, 1, 1, 16),
                                   (4, 4, 1, 33, 128), (2, 4, 2, 40, 48)])
def test_kernel_equals_the_reference_for_every_mask_form(shape) -> None:
    """Head dims that are not whole vectors (7, 20, 48), one key, grouped and ungrouped
    heads, and every mask the kernel reads: none, bool (per batch row, broadcast over
    the batch, per head), float (finite values added; ``-inf`` per head), all masked
    (zeros, not NaN)."""
    _built()
    b, h, kv, length, d = shape
    torch.manual_seed(0)
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, kv, length, d), torch.randn(b, kv, length, d)
    for name, mask in _masks(b, h, length).items():
        got = attention_kernel.decode_attention(q, k, v, mask, 0.3)
        assert got.shape == (b, h, 1, d) and not got.isnan().any(), name
        assert_close(got, _reference(q, k, v, mask, 0.3), reduction=length * d, what=f"{shape} {name}")
    assert bool((attention_kernel.decode_attention(q, k, v, _masks(b, h, length)["all-masked"], 0.3) == 0).all())


def test_positions_the_mask_drops_are_never_read() -> None:
    """A static cache whose unwritten rows hold NaN (as freed or uninitialised memory
    may): with the mask dropping them, the result is that of the written rows alone. A
    kernel reading them would return NaN (ATen's flash kernel does)."""
    _built()
    torch.manual_seed(0)
    b, h, kv, length, d, written = 2, 4, 2, 32, 16, 9
    q, k, v = torch.randn(b, h, 1, d), torch.randn(b, kv, length, d), torch.randn(b, kv, length, d)
    k[:, :, written:], v[:, :, written:] = float("nan"), float("nan")
    keep = (torch.arange(length) < written).view(1, 1, 1, length)
    for mask in (keep, torch.where(keep, 0.0, NEG)):
        got = attention_kernel.decode_attention(q, k, v, mask, d ** -0.5)
        want = _reference(q, k[:, :, :written], v[:, :, :written], None, d ** -0.5)
        assert not got.isnan().any()
        assert_close(got, want, reduction=written * d)


def test_kernel_split_over_threads_equals_the_reference() -> None:
    """With more than one thread the (batch, key/value head) pairs are split between
    threads (counts that do not split evenly): the same result."""
    _built()
    torch.manual_seed(0)
    for threads in each_thread_count(2, 3):
        for b, h, kv, length, d in [(5, 4, 2, 64, 64), (3, 6, 3, 128, 32), (1, 8, 8, 300, 64)]:
            q, k, v = torch.randn(b, h, 1, d), torch.randn(b, kv, length, d), torch.randn(b, kv, length, d)
            mask = torch.rand(b, 1, 1, length) > 0.3
            got = attention_kernel.decode_attention(q, k, v, mask, 0.2)
            assert_close(got, _reference(q, k, v, mask, 0.2), reduction=length * d,
                         what=f"{threads} threads, {(b, h, kv, length, d)}")


def test_kernel_refuses_what_it_does_not_read() -> None:
    """Several query positions, heads not a multiple of the key/value heads, a mask of
    another length, a non-contiguous key, another dtype: a ValueError naming the shapes
    and what was expected, never a read past a tensor."""
    _built()
    q, k = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 10, 8)
    out = torch.empty(2, 4, 1, 8)
    cases = [
        (torch.randn(2, 4, 3, 8), k, k, None, torch.empty(2, 4, 3, 8), r"query \(2, 4, 3, 8\)"),
        (torch.randn(2, 3, 1, 8), k, k, None, torch.empty(2, 3, 1, 8), "multiple of KV"),
        (q, k, k, torch.ones(2, 1, 1, 9, dtype=torch.bool), out, r"mask \(\(2, 1, 1, 9\)"),
        (q, k.transpose(2, 3).contiguous().transpose(2, 3), k, None, out, "contiguous"),
        (q.double(), k.double(), k.double(), None, out.double(), "float32"),
    ]
    for q_, k_, v_, m_, o_, match in cases:
        with pytest.raises(ValueError, match=match):
            attention_kernel.decode_attention_out(q_, k_, v_, m_, scale=0.5, out=o_)


def _hf_served_graphs(record: object | None = None) -> list[object]:
    return [e.graph for o in gc.get_objects() if type(o) is CaptureEngine and (record is None or o.record is record)
            for e in o.entries.values() if e.graph is not None and e.graph.program is not None]


@pytest.mark.slow
@torch.no_grad()
@pytest.mark.parametrize("how,batch", [("serve", 3), ("reduce-overhead", 1)])
def test_transformers_decoder_calls_the_kernel_and_equals_eager(how: str, batch: int) -> None:
    """A transformers Qwen2 (grouped-query attention) decoding over a StaticCache, served
    (frozen weights) at batch 3 and compiled in reduce-overhead at batch 1: every
    attention is graphgear's kernel, called by the CPU graph's kernel-call replay, and
    logits and the KV cache equal eager's at every step, past positions the cache had
    not written."""
    _built()
    from transformers import StaticCache

    cfg, model, ref = hf_qwen2_pair()
    f = graphgear.inference.serve(model) if how == "serve" else torch.compile(model, backend=_ro(warmup_iters=0))
    cache, ref_cache = StaticCache(config=cfg, max_cache_len=16), StaticCache(config=cfg, max_cache_len=16)
    tok = ref_tok = torch.randint(3, 100, (batch, 1), generator=torch.Generator().manual_seed(0))
    for p in range(7):
        pos = torch.full((batch, 1), p)
        out = f(input_ids=tok, cache=cache, position_ids=pos, use_cache=True).logits
        want = ref(input_ids=ref_tok, cache=ref_cache, position_ids=pos, use_cache=True).logits
        assert_close(out, want, reduction=128, what=f"step {p}")
        for layer, ref_layer in zip(cache.layers, ref_cache.layers):
            assert_close(layer.keys, ref_layer.keys, reduction=64, what="keys")
            assert_close(layer.values, ref_layer.values, reduction=64, what="values")
        tok, ref_tok = out[:, -1:].argmax(-1), want[:, -1:].argmax(-1)
    last = graphgear.stats().graphs[-1]
    assert last.passes.get("decode_attention", 0) == cfg.num_hidden_layers, last.passes
    calls = [c[0] for g in _hf_served_graphs(last) for c in g.program.calls]  # type: ignore[attr-defined]
    assert calls.count(attention_kernel.kernel()) == cfg.num_hidden_layers, "each layer's attention a kernel call"


def test_where_the_kernel_cannot_be_built_the_attention_is_written_out(monkeypatch, caplog) -> None:
    """No C++ compiler (the build raises): a warning says why and what runs instead, the
    pass writes the attention out for Inductor (no call of the op), and results equal
    eager's."""
    text = unbuildable_kernel(monkeypatch, caplog, attention_kernel.kernel)
    assert "decode attention kernel could not be built" in text and "runs as generated code" in text
    monkeypatch.setattr(attention_kernel, "kernel", lambda: None)
    seen = ops_compiled(monkeypatch, torch.ops.graphgear.decode_attention.default)

    def fn(q, k, v, mask):  # type: ignore[no-untyped-def]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 2

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 4, 12, 16), torch.randn(2, 4, 12, 16)
    mask = torch.arange(12).view(1, 1, 1, 12) < 5
    f = torch.compile(fn, backend=_ro(warmup_iters=0))
    with torch.no_grad():
        for _ in range(2):
            assert_close(f(q, k, v, mask), fn(q, k, v, mask), reduction=12 * 16)
    assert graphgear.stats().graphs[-1].passes.get("decode_attention") == 1
    assert seen and all(n == (0,) for n in seen), seen

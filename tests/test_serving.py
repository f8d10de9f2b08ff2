"""The serving option (graphgear.inference.serve): guard filter plus frozen parameters;
results equal eager, and guards on state other than modules still hold."""

from __future__ import annotations

import pytest
import torch

import graphgear
from graphgear.inference import serve, serving_guard_filter
from tests.helpers import assert_close

pytestmark = pytest.mark.inductor


@torch.no_grad()
def test_serve_decodes_like_eager_with_one_capture() -> None:
    from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder

    cfg = DecoderConfig(vocab_size=64, hidden_size=32, num_layers=2, intermediate_size=64, max_seq_len=16)
    model, ref = ToyDecoder(cfg).eval(), ToyDecoder(cfg).eval()
    ref.load_state_dict(model.state_dict())
    f = serve(model)
    tok = ref_tok = torch.tensor([[3]])
    for p in range(8):
        out, want = f(tok, torch.tensor([p])), ref(ref_tok, torch.tensor([p]))
        assert_close(out, want, reduction=64)
        tok, ref_tok = out[:, -1:].argmax(-1), want[:, -1:].argmax(-1)
    recs = graphgear.stats().graphs
    assert len(recs) == 1 and recs[0].captures == 1 and recs[0].fallbacks == []


_SCALE = torch.ones(4)  # a global tensor the compiled code reads: its tensor guard stays


def test_serving_guard_filter_drops_module_and_global_guards_only() -> None:
    seen: list[tuple[int, int]] = []
    global _SCALE

    def spy(entries):  # type: ignore[no-untyped-def]
        keep = serving_guard_filter(entries)
        seen.append((len(entries), sum(keep)))
        for e, k in zip(entries, keep):  # module guards and non-tensor globals go, the rest stays
            module = e.orig_guard.source.is_unspecialized_nn_module()
            assert k == (not module and (not e.is_global or e.guard_type == "TENSOR_MATCH")), e.name
        return keep

    class Flag:
        on = True

    state = Flag()
    net = torch.nn.Linear(4, 4)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return net(x) * _SCALE + (1.0 if state.on else -1.0)

    f = torch.compile(fn, backend=graphgear.get_backend(), options={"guard_filter_fn": spy})
    x = torch.randn(2, 4)
    with torch.no_grad():
        assert_close(f(x), net(x) + 1.0, reduction=4)
        state.on = False  # not a module nor a global: its guard is kept, so this recompiles correctly
        assert_close(f(x), net(x) - 1.0, reduction=4)
        _SCALE = torch.full((2, 1), 2.0)  # a global tensor of another shape: its guard is kept
        assert_close(f(x), net(x) * 2.0 - 1.0, reduction=4)
    assert seen and all(kept < total for total, kept in seen)


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 3])
@torch.no_grad()
def test_serve_transformers_static_cache_keeps_the_cache_guard(batch: int) -> None:
    """HF's StaticCache initialises lazily on the first call; the guard on its
    ``is_initialized`` is not a module guard, so the served model compiles a second
    graph for the initialised cache instead of replaying the first (which would write a
    new cache each step). Only parameters become constants of the compiled code (at
    batch 3, of the C++ GEMM template's packed products), never the cache's write
    position or other state that changes between steps."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, StaticCache

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    model, ref = Qwen2ForCausalLM(cfg).eval(), Qwen2ForCausalLM(cfg).eval()
    ref.load_state_dict(model.state_dict())
    f = serve(model)
    cache, ref_cache = StaticCache(config=cfg, max_cache_len=16), StaticCache(config=cfg, max_cache_len=16)

    def decode(steps: int) -> None:
        tok = ref_tok = torch.arange(5, 5 + batch).view(batch, 1)
        for p in range(steps):
            pos = torch.full((batch, 1), p)
            out = f(input_ids=tok, cache=cache, position_ids=pos, use_cache=True).logits
            want = ref(input_ids=ref_tok, cache=ref_cache, position_ids=pos, use_cache=True).logits
            assert_close(out, want, reduction=128)
            tok, ref_tok = out[:, -1:].argmax(-1), want[:, -1:].argmax(-1)
            assert_close(cache.layers[0].keys, ref_cache.layers[0].keys, reduction=64)

    decode(6)
    cache.reset()  # the cache's tensors are the user's, never a graph's output
    ref_cache.reset()
    decode(4)


@pytest.mark.slow
@torch.no_grad()
def test_serve_transformers_in_bfloat16_is_as_accurate_as_eager_bfloat16() -> None:
    """A served bf16 model (graphgear's C++ products are fp32-only, so its products stay
    Inductor's) is checked against the same model in float32: its logits and KV cache
    must be no further from float32 than eager bf16's are, step after step. The tokens
    fed are float32's choices, so a near-tie in argmax cannot make the runs diverge."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, StaticCache

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = Qwen2ForCausalLM(cfg).eval()
    eager, model = Qwen2ForCausalLM(cfg).eval(), Qwen2ForCausalLM(cfg).eval()
    for m in (eager, model):
        m.load_state_dict(ref.state_dict())
        m.to(torch.bfloat16)
    f = serve(model)
    caches = [StaticCache(config=cfg, max_cache_len=16) for _ in range(3)]
    tok = torch.tensor([[5], [9]])
    for p in range(5):
        pos = torch.full((2, 1), p)
        outs = [m(input_ids=tok, cache=c, position_ids=pos, use_cache=True).logits
                for m, c in zip((ref, eager, f), caches)]
        want, got_eager, got = outs[0], outs[1].float(), outs[2].float()
        assert got.dtype == torch.float32 and outs[2].dtype == torch.bfloat16
        err_eager, err = (got_eager - want).abs().max().item(), (got - want).abs().max().item()
        # bf16 has 8 bits of mantissa: the two bf16 runs round differently, so allow each
        # step twice eager's error plus one bf16 unit of the largest logit
        unit = torch.finfo(torch.bfloat16).eps * want.abs().max().item()
        assert err <= 2 * err_eager + unit, f"step {p}: served {err:.3g} from float32, eager bf16 {err_eager:.3g}"
        keys = [c.layers[0].keys.float() for c in caches]
        kv_eager, kv = (keys[1] - keys[0]).abs().max().item(), (keys[2] - keys[0]).abs().max().item()
        kv_unit = torch.finfo(torch.bfloat16).eps * keys[0].abs().max().item()
        assert kv <= 2 * kv_eager + kv_unit, f"step {p}: served KV {kv:.3g} from float32, eager bf16 {kv_eager:.3g}"
        tok = want[:, -1:].argmax(-1)
    recs = graphgear.stats().graphs
    assert recs and all(r.fallbacks == [] for r in recs), [r.fallbacks for r in recs]

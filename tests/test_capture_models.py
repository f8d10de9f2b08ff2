"""reduce-overhead on real transformers models: greedy decoding with a static KV cache.

Small configs, random weights, offline. The compiled ``forward`` must give eager's
tokens and logits, and the capture counts follow the rules: one FX graph per phase
(prefill, decode), one warm-up run, then one capture; a second ``generate`` brings a
fresh cache whose tensors sit at new addresses, which captures each phase again.
"""

from __future__ import annotations

import pytest
import torch

import graphgear
from tests.helpers import assert_close

pytestmark = [pytest.mark.slow, pytest.mark.inductor]

NEW = 8


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    return LlamaForCausalLM(cfg).eval()


def _gpt2() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, bos_token_id=0, eos_token_id=None)
    return GPT2LMHeadModel(cfg).eval()


@torch.no_grad()
@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_greedy_static_cache_decoding_matches_eager(build: object) -> None:
    torch.manual_seed(0)
    model = build()  # type: ignore[operator]
    ids = torch.randint(1, 128, (1, 6))
    kw = dict(max_new_tokens=NEW, do_sample=False, cache_implementation="static", pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    ref = model.generate(ids, **kw)
    config = graphgear.CompilerConfig()
    config.mode = "reduce-overhead"
    model.forward = torch.compile(model.forward, backend=graphgear.get_backend(config))
    runs = [model.generate(ids, **kw) for _ in range(2)]
    for out in runs:
        assert out.sequences.tolist() == ref.sequences.tolist()
        for got, want in zip(out.logits, ref.logits):
            assert_close(got, want, reduction=1024)
    graphs = graphgear.stats().graphs
    assert len(graphs) == 2, str(graphgear.stats())
    by_replays = sorted(graphs, key=lambda g: g.replays)
    prefill, decode = by_replays
    assert all(g.fallbacks == [] for g in graphs), str(graphgear.stats())
    # prefill: run 1 warms up, run 2 (new cache) captures; no replay
    assert (prefill.uncaptured_runs, prefill.captures, prefill.replays) == (1, 1, 0)
    # decode: NEW - 1 steps per generate; 1 warm-up + 1 capture in the first; the
    # second's cache moved and is rebound (no new capture); every other step replays
    assert (decode.uncaptured_runs, decode.captures) == (1, 1) and decode.rebinds >= 1
    assert decode.replays == 2 * (NEW - 1) - 2

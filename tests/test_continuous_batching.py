"""transformers' continuous-batching loop (``generate_batch``) with graphgear as its compile
backend, as a user sets it up (docs/guides/continuous-batching.md), and ``stats()``
naming each graph of a loop by where it comes from."""

from __future__ import annotations

import pytest
import torch

import graphgear
from graphgear.stats import graph_source
from tests.models.tied_blocks import BreakBlock


def test_stats_name_each_graph_by_its_function_and_line() -> None:
    """A block with a graph break compiles two graphs: the first named after the
    function, the second after the line it resumes from, both with the block's file."""
    block = torch.compile(BreakBlock(), backend="graphgear", options={"debug.run_eagerly": True})
    block(torch.randn(2, 8))
    sources = [g.source for g in graphgear.stats().graphs]
    assert len(sources) == 2, sources
    assert sources[0].startswith("forward (tied_blocks.py:"), sources
    assert sources[1].startswith("forward after line "), sources
    assert "(tied_blocks.py:" in sources[1], sources
    assert "source" in str(graphgear.stats()).splitlines()[0]


def test_graph_source_is_empty_without_stack_traces() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    assert graph_source(gm) == ""


def _qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, initializer_range=0.2)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_generate_batch_with_graphgear_gives_eager_tokens_and_compiles_nothing_on_a_repeat_wave(
        mode: str) -> None:
    """Waves of prompts of new lengths through one persistent manager give eager's
    tokens, and a wave of shapes seen twice before compiles and captures nothing (no
    dynamo frame, no graphgear compile or capture), although the loop runs every wave on
    a new thread: the next thread takes over the captures of the one that ended."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig, ContinuousBatchingConfig, GenerationConfig

    model = _qwen2()
    gen = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)
    g = torch.Generator().manual_seed(3)
    waves = [[torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]
             for lengths in ((5, 9, 7, 12), (6, 11, 4, 8))]

    def cbc(cc: object) -> ContinuousBatchingConfig:
        return ContinuousBatchingConfig(varlen_compile_config=cc, use_cuda_graph=False, num_blocks=16,
                                        max_batch_tokens=32, q_padding_interval_size=8,
                                        kv_padding_interval_size=64)

    def tokens(out: dict) -> list[list[int]]:
        return [out[k].generated_tokens for k in sorted(out, key=lambda r: int(r.rsplit("_", 1)[1]))]

    eager = [tokens(model.generate_batch(w, generation_config=gen, continuous_batching_config=cbc(None)))
             for w in waves]
    compiled_cfg = cbc(CompileConfig(backend="graphgear", mode=None, options={"mode": mode}))
    for w, ref in zip(waves + waves[:1], eager + eager[:1]):
        out = model.generate_batch(w, generation_config=gen, continuous_batching_config=compiled_cfg,
                                   persistent_manager=True)
        assert tokens(out) == ref
    graphs = graphgear.stats().graphs
    assert graphs and all(r.mode == mode for r in graphs)
    assert all(r.source for r in graphs), [r.name for r in graphs if not r.source]
    assert any("modeling_qwen2.py" in r.source for r in graphs)
    before = (counters["frames"]["ok"], sum(r.compiles for r in graphs), sum(r.captures for r in graphs))
    out = model.generate_batch(waves[0], generation_config=gen, continuous_batching_config=compiled_cfg,
                               persistent_manager=True)
    assert tokens(out) == eager[0]
    graphs = graphgear.stats().graphs
    after = (counters["frames"]["ok"], sum(r.compiles for r in graphs), sum(r.captures for r in graphs))
    assert after == before, f"(frames, compiles, captures) before {before}, after {after}"
    if mode == "reduce-overhead":
        assert sum(r.replays for r in graphs) > 0


@pytest.mark.slow
@pytest.mark.inductor
def test_generate_batch_in_bfloat16_gives_eager_tokens() -> None:
    """bf16 weights: reduce-overhead's greedy tokens equal eager's. The random weights
    (``initializer_range=0.2``) give top-2 logit margins far above bf16's rounding, so a
    difference here is an error, not a tie broken the other way."""
    from transformers import CompileConfig, ContinuousBatchingConfig, GenerationConfig

    model = _qwen2().to(torch.bfloat16)
    gen = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (6, 10, 5, 9)]

    def run(cc: object, **kw: object) -> list[list[int]]:
        cbc = ContinuousBatchingConfig(varlen_compile_config=cc, use_cuda_graph=False, num_blocks=16,
                                       max_batch_tokens=32, q_padding_interval_size=8,
                                       kv_padding_interval_size=64)
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cbc, **kw)
        return [out[k].generated_tokens for k in sorted(out, key=lambda r: int(r.rsplit("_", 1)[1]))]

    eager = run(None)
    cc = CompileConfig(backend="graphgear", mode=None, options={"mode": "reduce-overhead"})
    for _ in range(3):
        assert run(cc, persistent_manager=True) == eager
    assert sum(r.replays for r in graphgear.stats().graphs) > 0

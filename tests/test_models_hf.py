"""Real third-party models: transformers Llama and GPT-2 (small configs, random weights)
through the pipeline, against eager: logits, every parameter's gradient, and the static
KV cache written in place during generation."""

from __future__ import annotations

import pytest
import torch

import graphgear
from tests.helpers import check_against_eager
from tests.models import hf_gpt2, hf_llama

pytestmark = pytest.mark.slow

MODELS = {"llama": hf_llama, "gpt2": hf_gpt2}


def _backend(mode: str):
    cfg = graphgear.CompilerConfig()
    if mode == "eager":
        cfg.debug.run_eagerly = True
    else:
        cfg.mode = mode
    return graphgear.get_backend(compiler_config=cfg)


def _ids():
    return [torch.randint(0, 128, (2, 8))]


def _loss(out) -> torch.Tensor:
    return out.logits.float().pow(2).mean()


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("train", [False, True])
def test_pipeline_matches_eager(name: str, dynamic: bool, train: bool) -> None:
    model = MODELS[name]()
    model.train(train)
    backend = _backend("eager")
    check_against_eager(
        model, _ids, lambda m: torch.compile(m, backend=backend, dynamic=dynamic, fullgraph=True),
        train=train, steps=2, reduction=256, loss_fn=_loss,
    )
    stages = [g.stage for g in graphgear.stats().graphs]
    assert stages == (["forward", "backward"] if train else ["inference"])


@pytest.mark.inductor
@pytest.mark.parametrize("name, train", [("llama", False), ("llama", True), ("gpt2", False), ("gpt2", True)])
def test_max_autotune_matches_eager(name: str, train: bool) -> None:
    model = MODELS[name]()
    model.train(train)
    backend = _backend("max-autotune")
    check_against_eager(
        model, _ids, lambda m: torch.compile(m, backend=backend, fullgraph=True),
        train=train, steps=2, reduction=1024, loss_fn=_loss,
    )
    assert {g.mode for g in graphgear.stats().graphs} == {"max-autotune"}


@pytest.mark.parametrize("name", list(MODELS))
def test_static_cache_generation_matches_eager(name: str) -> None:
    """Greedy decoding with a static cache: the compiled forward writes the cache in
    place (a graph input mutation) and produces the same tokens as eager."""
    model = MODELS[name]()
    ids = torch.randint(0, 128, (2, 5))
    kw = dict(max_new_tokens=6, do_sample=False, cache_implementation="static", pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        model.forward = torch.compile(model.forward, backend=_backend("eager"), fullgraph=True)
        out = model.generate(ids, **kw)
    assert torch.equal(out, ref)
    graphs = graphgear.stats().graphs
    assert graphs and all(g.stage == "inference" for g in graphs)
    assert len(graphs) <= 3  # prefill, decode (and at most one more for a new cache shape)

"""The pipeline against eager PyTorch: outputs, gradients and in-place mutations, with
static and dynamic shapes, fullgraph and graph breaks.

``debug.run_eagerly`` runs the optimised AOT graph as it is, so these tests check the
whole pipeline (AOTAutograd, partitioning, decompositions, passes, input mutations)
without a code generator; the modes' own tests reuse the same checks.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import graphgear
from tests.helpers import assert_close, check_against_eager
from tests.models import MLP, ConvNet, GraphBreakMLP, small_decoder


def eager_backend(**options: object) -> graphgear.backend.GraphgearBackend:
    cfg = graphgear.CompilerConfig()
    cfg.debug.run_eagerly = True
    for k, v in options.items():
        graphgear.config.apply_options(cfg, {k: v})
    return graphgear.get_backend(compiler_config=cfg)


def decoder_inputs(batch: int = 2):
    pos = itertools.count()

    def make():
        p = next(pos)
        return [torch.randint(0, 128, (batch, 1)), torch.tensor([p])]

    return make


CASES = {
    "mlp": (MLP, lambda: [torch.randn(4, 16)]),
    "conv": (ConvNet, lambda: [torch.randn(2, 3, 8, 8)]),
    "decoder": (small_decoder, None),
    "graph_break": (GraphBreakMLP, lambda: [torch.randn(4, 16)]),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("train", [False, True])
def test_run_eagerly_matches_eager(name: str, dynamic: bool, train: bool) -> None:
    build, inputs = CASES[name]
    model = build()
    if train:
        model.train()
    else:
        model.eval()
    inputs = inputs or decoder_inputs()
    fullgraph = name != "graph_break"
    backend = eager_backend()
    check_against_eager(
        model, inputs,
        lambda m: torch.compile(m, backend=backend, dynamic=dynamic, fullgraph=fullgraph),
        train=train, steps=3,
        # a training step through a KV cache leaves autograd history on it
        before_step=(lambda m: m.reset_cache()) if train and name == "decoder" else None,
    )
    stages = {g.stage for g in graphgear.stats().graphs}
    assert stages == ({"forward", "backward"} if train else {"inference"})
    n_graphs = sum(g.stage != "backward" for g in graphgear.stats().graphs)
    assert n_graphs == (2 if name == "graph_break" else 1)


def test_decoder_kv_cache_mutation_visible_to_caller() -> None:
    """The in-place KV-cache write happens inside the graph and lands in the caller's
    buffer (keep_inference_input_mutations)."""
    model = small_decoder().eval()
    compiled = torch.compile(model, backend=eager_backend(), fullgraph=True)
    cache = model.layers[0].attn.k_cache
    assert cache.abs().sum() == 0
    with torch.no_grad():
        compiled(torch.tensor([[5], [6]]), torch.tensor([3]))
    assert cache[:2, :, 3].abs().sum() > 0
    assert cache[:2, :, :3].abs().sum() == 0 and cache[:2, :, 4:].abs().sum() == 0
    (graph,) = graphgear.stats().graphs
    assert graph.stage == "inference"


def test_user_input_mutation_in_place() -> None:
    def f(x, buf):
        buf.add_(x)
        return buf * 2

    backend = eager_backend()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    x, buf = torch.randn(5), torch.zeros(5)
    buf_e = torch.zeros(5)
    for _ in range(3):
        out = compiled(x, buf)
        ref = f(x, buf_e)
        assert_close(out, ref)
        assert_close(buf, buf_e)


@pytest.mark.inductor
def test_default_backend_string_max_autotune_matches_eager() -> None:
    """``backend="graphgear"`` with no import-time setup: default mode (Inductor)."""
    model = MLP().eval()
    check_against_eager(model, lambda: [torch.randn(4, 16)],
                        lambda m: torch.compile(m, backend="graphgear"), steps=2)
    (graph,) = graphgear.stats().graphs
    assert graph.mode == "max-autotune" and graph.compiles == 1


@pytest.mark.inductor
def test_max_autotune_training_matches_eager() -> None:
    model = MLP().train()
    check_against_eager(model, lambda: [torch.randn(4, 16)],
                        lambda m: torch.compile(m, backend="graphgear"), train=True, steps=2)
    assert [g.stage for g in graphgear.stats().graphs] == ["forward", "backward"]

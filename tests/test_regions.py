"""Repeated regions (``graphgear.regions``): a model's identical blocks become one shared
subgraph, traced and compiled once, called for each block. Every case is checked against
eager: outputs, gradients, and buffers written in place (a per-block cache)."""

from __future__ import annotations

import copy

import pytest
import torch

import graphgear
from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder
from graphgear.regions import outline_repeated_regions
from tests.helpers import assert_close, check_against_eager, last_record, make_backend
from tests.models.stacked import CachedStack, Stack, ViewStack

MODES = ["reduce-overhead", "max-autotune", "eager"]


def _dynamo_graph(model: torch.nn.Module, *args: torch.Tensor) -> torch.fx.GraphModule:
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=grab, fullgraph=True)(*args)
    return graphs[0]


def test_identical_blocks_share_one_subgraph() -> None:
    gm = _dynamo_graph(Stack(depth=4), torch.randn(2, 16))
    outlined, made = outline_repeated_regions(gm)
    assert list(made.values()) == [4]
    invokes = [n for n in outlined.graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]
    assert len(invokes) == 4
    assert len({n.args[0].target for n in invokes}) == 1  # one subgraph module for all four
    # the original graph is left as it was (the backend falls back to it)
    assert not any("invoke_subgraph" in str(n.target) for n in gm.graph.nodes)


def test_blocks_that_differ_by_a_constant_are_not_merged() -> None:
    # blocks 0 and 2 are the same code (scale 1.0), 1 and 3 another (scale 0.5)
    gm = _dynamo_graph(Stack(depth=4, scales=[1.0, 0.5, 1.0, 0.5]), torch.randn(2, 16))
    _, made = outline_repeated_regions(gm)
    assert sorted(made.values()) == [2, 2]
    gm = _dynamo_graph(Stack(depth=3, scales=[1.0, 0.5, 0.25]), torch.randn(2, 16))
    assert outline_repeated_regions(gm)[1] == {}


@pytest.mark.inductor
@pytest.mark.parametrize("mode", MODES)
def test_stack_matches_eager_with_one_region(mode: str) -> None:
    model = Stack(depth=4).eval()
    check_against_eager(model, lambda: [torch.randn(3, 16)],
                        lambda m: torch.compile(m, backend=make_backend(mode, repeated_regions=True), fullgraph=True), steps=3)
    assert last_record().regions == {"Block_0": 4}


@pytest.mark.inductor
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_constant_per_block_stays_correct(mode: str) -> None:
    model = Stack(depth=4, scales=[1.0, 0.5, 1.0, 0.5]).eval()
    check_against_eager(model, lambda: [torch.randn(3, 16)],
                        lambda m: torch.compile(m, backend=make_backend(mode, repeated_regions=True), fullgraph=True), steps=2)
    assert sorted(last_record().regions.values()) == [2, 2]


@pytest.mark.inductor
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_blocks_writing_their_cache_in_place(mode: str) -> None:
    model = CachedStack(depth=3).eval()
    pos = iter(range(8))
    check_against_eager(model, lambda: [torch.randn(1, 16), torch.tensor([next(pos)])],
                        lambda m: torch.compile(m, backend=make_backend(mode, repeated_regions=True), fullgraph=True), steps=4)
    assert last_record().regions == {"CachedBlock_0": 3}


@pytest.mark.inductor
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_training_graphs_keep_every_block(mode: str) -> None:
    # torch 2.13's differentiation of a shared subgraph gave wrong gradients here:
    # training graphs are compiled block by block, and their gradients match eager
    model = Stack(depth=3).train()
    check_against_eager(model, lambda: [torch.randn(4, 16)],
                        lambda m: torch.compile(m, backend=make_backend(mode, repeated_regions=True), fullgraph=True),
                        train=True, steps=2)
    assert all(not g.regions for g in graphgear.stats().graphs)


@pytest.mark.inductor
def test_output_aliasing_an_input_is_correct() -> None:
    model = ViewStack(depth=3).eval()
    check_against_eager(model, lambda: [torch.randn(2, 16)],
                        lambda m: torch.compile(m, backend=make_backend("max-autotune"), fullgraph=True))


@pytest.mark.inductor
def test_regions_off_compiles_every_block() -> None:
    model = Stack(depth=4).eval()
    backend = make_backend("max-autotune", repeated_regions=False)
    check_against_eager(model, lambda: [torch.randn(3, 16)], lambda m: torch.compile(m, backend=backend))
    assert last_record().regions == {}


@pytest.mark.inductor
def test_split_ops_inside_a_region_cut_it_whole() -> None:
    # pieces cut at the linear inside every block: the regions are not outlined
    model = Stack(depth=3).eval()
    backend = make_backend("reduce-overhead", split_ops=("aten.gelu",), repeated_regions=True,
                           **{"capture_config.mode": "piecewise"})
    check_against_eager(model, lambda: [torch.randn(3, 16)], lambda m: torch.compile(m, backend=backend), steps=3)
    rec = last_record()
    assert rec.regions == {} and rec.pieces


@pytest.mark.inductor
def test_uncapturable_op_in_a_region_falls_back_to_whole_regions() -> None:
    # .item() in each block: piecewise capture must cut there, so the blocks compile on their own

    class ItemBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)
            self.lin2 = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x).relu() * 2 + 1
            k = torch.nonzero(y > 1.5).shape[0]
            return self.lin2(y).tanh() + k

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(ItemBlock() for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for b in self.blocks:
                x = b(x)
            return x

    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    try:
        check_against_eager(Model().eval(), lambda: [torch.randn(2, 16)],
                            lambda m: torch.compile(m, backend=make_backend("reduce-overhead", repeated_regions=True)),
                            steps=3)
    finally:
        torch._dynamo.config.capture_dynamic_output_shape_ops = False
    assert all(not g.regions for g in graphgear.stats().graphs)


@pytest.mark.inductor
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
@pytest.mark.parametrize("compile_sizes", [(), (4,), "all"])
def test_gears_of_a_stack(mode: str, compile_sizes) -> None:
    # a graph of dynamic sizes is not outlined (Inductor's code of dynamic sizes calling a
    # shared subgraph was wrong at every size but the first); one compile with dynamic
    # sizes serves every gear (compile_sizes: those specialised), equal to eager
    model = Stack(depth=4).eval()
    backend = make_backend(mode, compile_sizes=compile_sizes, repeated_regions=True)
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for n in [2, 4, 8, 4, 2, 8]:
            x = torch.randn(n, 16)
            graphgear.set_dim_gears(x, {0: [2, 4, 8]})
            assert_close(compiled(x), model(x), reduction=64)
    rec = last_record()
    expected = {(): 1, (4,): 2, "all": 3}[compile_sizes]
    assert rec.regions == {} and rec.compiles == expected and len(rec.key_seconds) == 3


@pytest.mark.inductor
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_decoder_gears_share_one_compile_and_equal_eager(mode: str) -> None:
    # graphgear's decoder (a KV cache per layer written in place, one cache for every
    # batch): each gear from the one compile with dynamic sizes, every size equal to eager
    cfg = DecoderConfig(max_batch_size=4)
    model = ToyDecoder(cfg).eval()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=make_backend(mode, compile_sizes=(), repeated_regions=True))
    with torch.no_grad():
        for step, b in enumerate([1, 2, 4, 2, 1, 4]):
            tok = torch.randint(0, cfg.vocab_size, (b, 1))
            graphgear.set_dim_gears(tok, {0: [1, 2, 4]})
            pos = torch.tensor([step])
            assert_close(compiled(tok, pos), ref(tok, pos), reduction=256, what=f"batch {b}")
        for lc, lr in zip(model.layers, ref.layers):
            assert_close(lc.attn.k_cache, lr.attn.k_cache, reduction=256, what="k cache")


@pytest.mark.inductor
def test_gear_padding_keeps_every_block() -> None:
    # padding's hazard check reads every op: a padded graph is not outlined
    model = Stack(depth=3).eval()
    compiled = torch.compile(model, backend=make_backend("max-autotune", gear_padding=True))
    with torch.no_grad():
        for n in [3, 5]:
            x = torch.randn(n, 16)
            graphgear.set_dim_gears(x, {0: [4, 8]})
            assert_close(compiled(x), model(x), reduction=64)
    assert last_record().regions == {}


@pytest.mark.inductor
@pytest.mark.parametrize("mode, outlined", [("max-autotune", True), ("reduce-overhead", False)])
def test_auto_outlines_except_for_the_cpu_graph(mode: str, outlined: bool) -> None:
    # the CPU graph replays straight-line code as a fixed list of kernel calls: a graph
    # that calls a shared subgraph it would run through Inductor's wrapper, slower
    model = Stack(depth=4).eval()
    check_against_eager(model, lambda: [torch.randn(3, 16)],
                        lambda m: torch.compile(m, backend=make_backend(mode), fullgraph=True))
    assert bool(last_record().regions) is outlined

"""Piecewise capture (``capture_config.mode``, ``split_ops``, ``split_uncapturable``):
graphs cut at split nodes, the pieces captured and replayed, the split nodes run between
them; every result checked against eager PyTorch."""

from __future__ import annotations

import operator
import os
import warnings

import pytest
import torch

import graphgear
from tests.helpers import assert_close, run_threads
from tests.helpers import last_record as _rec
from tests.helpers import make_backend as _ro
from tests.models.piecewise import (
    CACHE_WRITE,
    CACHE_WRITES,
    WINDOW_SUM,
    Attention,
    CachedWindowNet,
    WindowNet,
    write_then_read,
    write_two_layers,
)

pytestmark = pytest.mark.inductor

FLASH = "aten._scaled_dot_product_flash_attention_for_cpu"


def _counts(rec: graphgear.stats.GraphRecord) -> list[tuple[int, int]]:
    return [(p.captures, p.replays) for p in rec.pieces]


def _noisy(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = (x + 1).sin()
    return h * 2, h + torch.randn_like(h)


@torch.no_grad()
def test_random_op_is_a_split_point_by_default() -> None:
    f = torch.compile(_noisy, backend=_ro())
    x = torch.randn(16)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="graphgear")  # a split is no fallback: no warning
        outs = [tuple(t.clone() for t in f(x)) for _ in range(4)]
    want = (x + 1).sin() * 2
    for det, _ in outs:
        assert_close(det, want)
    noise = [n - (x + 1).sin() for _, n in outs]
    assert all(not torch.equal(noise[0], n) for n in noise[1:]), "replay repeated the captured draw"
    r = _rec()
    assert [op for op, _ in r.splits] == ["aten.randn_like"] and r.fallbacks == []
    assert len(r.pieces) == 2 and _counts(r) == [(1, 2), (1, 2)]  # a warm-up run, a capture, replays


@torch.no_grad()
def test_split_uncapturable_false_sends_the_graph_to_fallback_with_a_hint() -> None:
    f = torch.compile(_noisy, backend=_ro(split_uncapturable=False))
    with pytest.warns(UserWarning, match=r"aten.randn_like.*split_uncapturable=True"):
        f(torch.randn(16))
    r = _rec()
    assert r.pieces == [] and r.captures == 0 and [op for op, _ in r.fallbacks] == ["aten.randn_like"]


@torch.no_grad()
def test_item_in_the_middle_captures_both_sides() -> None:
    def normalised(x: torch.Tensor) -> torch.Tensor:
        h = x.relu() @ x.T
        k = (h > 0).sum().item()
        return torch.tanh(h / (k + 1)) @ x

    f = torch.compile(normalised, backend=_ro(), fullgraph=True)
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        for i in range(5):
            x = torch.randn(4, 4) + (i - 2) * 0.3  # k differs between calls
            assert_close(f(x), normalised(x), reduction=4)
    r = _rec()
    assert "aten._local_scalar_dense" in [op for op, _ in r.splits]
    assert len(r.pieces) == 2 and _counts(r) == [(1, 3), (1, 3)] and r.fallbacks == []


@torch.no_grad()
def test_a_split_op_int_is_no_part_of_the_graph_key() -> None:
    torch.manual_seed(0)
    net = WindowNet().eval()
    f = torch.compile(net, backend=_ro(split_ops=[WINDOW_SUM]))
    x = torch.randn(3, 8)
    for n in [1, 2, 3, 4, 5, 6, 7, 8, 2, 5]:
        assert_close(f(x, n), net(x, n), reduction=8, what=f"n={n}")
    r = _rec()  # from n=2 on, dynamo's graph takes n as an input
    assert r.splits == [("ggtest.window_sum", "listed in capture_config.split_ops")]
    assert _counts(r) == [(1, 7), (1, 7)], str(graphgear.stats())
    assert r.compiles == 1


@torch.no_grad()
def test_full_and_piecewise_captures_a_listed_op_whole_when_the_key_fixes_its_args() -> None:
    torch.manual_seed(0)
    net = WindowNet().eval()
    f = torch.compile(net, backend=_ro(split_ops=[WINDOW_SUM]), dynamic=False)
    x = torch.randn(3, 8)
    for _ in range(3):
        assert_close(f(x, 4), net(x, 4), reduction=8)
    r = _rec()  # n is a constant of the graph: no cut needed
    assert r.pieces == [] and (r.captures, r.replays) == (1, 1)

    graphgear.reset()
    f = torch.compile(net, backend=_ro(split_ops=[WINDOW_SUM], **{"capture_config.mode": "piecewise"}),
                      dynamic=False)
    for _ in range(3):
        assert_close(f(x, 4), net(x, 4), reduction=8)
    assert _counts(_rec()) == [(1, 1), (1, 1)]  # 'piecewise' cuts at every listed node


@torch.no_grad()
def test_split_ops_with_mode_full_is_a_config_error() -> None:
    f = torch.compile(WindowNet(), backend=_ro(split_ops=[WINDOW_SUM], **{"capture_config.mode": "full"}))
    with pytest.raises(Exception) as info:
        f(torch.randn(2, 8), 3)
    err = graphgear.errors.graphgear_error(info.value)
    assert isinstance(err, graphgear.ConfigError), info.value
    assert "capture_config.split_ops" in str(err) and "mode='full'" in str(err)


@torch.no_grad()
def test_sdpa_as_a_split_op() -> None:
    torch.manual_seed(0)
    m = Attention().eval()
    f = torch.compile(m, backend=_ro(split_ops=[FLASH], **{"capture_config.mode": "piecewise"}))
    for _ in range(4):
        x = torch.randn(2, 5, 16)
        assert_close(f(x), m(x), reduction=16)
    r = _rec()
    assert [op for op, _ in r.splits] == [FLASH]
    assert _counts(r) == [(1, 2), (1, 2)]


@torch.no_grad()
def test_a_cache_written_in_a_piece_matches_eager() -> None:
    torch.manual_seed(0)
    net, ref = CachedWindowNet(), CachedWindowNet()
    ref.load_state_dict(net.state_dict())
    f = torch.compile(net, backend=_ro(split_ops=[WINDOW_SUM]))
    for p in range(4):
        x = torch.randn(1, 8)
        n = 1 + p * 2
        assert_close(f(x, torch.tensor([p]), n), ref(x, torch.tensor([p]), n), reduction=32)
        assert_close(net.cache, ref.cache, reduction=8, what="cache")  # each write happened once
    assert sum(c for c, _ in _counts(_rec())) >= 1


@torch.no_grad()
def test_gears_with_precompile_give_pieces_per_gear() -> None:
    torch.manual_seed(0)
    net = WindowNet().eval()
    f = torch.compile(net, backend=_ro(split_ops=[WINDOW_SUM], gear_padding=True,
                                       **{"capture_config.mode": "piecewise"}))
    x = torch.randn(8, 8)
    graphgear.set_dim_gears(x, {0: [1, 2, 4, 8]})
    graphgear.inference.precompile_gears(f, x, 3)
    compiles = _rec().compiles
    for batch in [1, 3, 5, 8, 2]:
        y = torch.randn(batch, 8)
        assert_close(f(y, 3), net(y, 3), reduction=8, what=f"batch {batch}")
    r = _rec()
    assert r.compiles == compiles, "a gear compiled after precompile_gears"
    assert len(r.pieces) == 2 and r.fallbacks == []
    assert all(c == 4 for c, _ in _counts(r)), "one capture per piece per gear"


def test_threads_each_get_their_own_results() -> None:
    torch.manual_seed(0)
    net = WindowNet().eval()
    f = torch.compile(net, backend=_ro(split_ops=[WINDOW_SUM]))
    inputs = [(torch.randn(3, 8) + k, 2 + k) for k in range(4)]
    with torch.no_grad():
        wants = [net(x, n) for x, n in inputs]
        f(*inputs[0])
        f(*inputs[1])
    errors: list[str] = []

    def worker(k: int) -> None:
        x, n = inputs[k]
        with torch.no_grad():
            for step in range(50):
                out = f(x, n)
                if not torch.allclose(out, wants[k], atol=1e-5, rtol=1e-4):
                    errors.append(f"thread {k} step {step}: wrong result")
                    return

    run_threads(worker, len(inputs))
    assert not errors, errors[:4]


@torch.no_grad()
def test_reset_releases_live_outputs_and_recaptures() -> None:
    torch.manual_seed(0)
    net = WindowNet().eval()
    f = torch.compile(net, backend=_ro(split_ops=[WINDOW_SUM], warmup_iters=0))
    x = torch.randn(3, 8)
    f(x, 2)
    out = f(x, 3)
    graphgear.reset()
    with pytest.raises(RuntimeError, match="released"):
        out + 0
    assert_close(f(x, 4), net(x, 4), reduction=8)
    assert_close(f(x, 5), net(x, 5), reduction=8)


@torch.no_grad()
def test_an_error_in_a_split_op_reaches_the_caller_and_state_survives() -> None:
    torch.manual_seed(0)
    net, ref = CachedWindowNet(), CachedWindowNet()
    ref.load_state_dict(net.state_dict())
    f = torch.compile(net, backend=_ro(split_ops=[WINDOW_SUM]))
    x = torch.randn(1, 8)
    for p, n in enumerate([1, 2, 3]):
        f(x, torch.tensor([p]), n)
        ref(x, torch.tensor([p]), n)
    with pytest.raises(ValueError, match="n=9 is outside 1..8"):
        f(x, torch.tensor([3]), 9)
    with pytest.raises(ValueError, match="n=9 is outside 1..8"):
        ref(x, torch.tensor([3]), 9)
    assert_close(net.cache, ref.cache, reduction=8, what="cache after the error")
    assert_close(f(x, torch.tensor([0]), 4), ref(x, torch.tensor([0]), 4), reduction=32)
    assert_close(net.cache, ref.cache, reduction=8, what="cache")


@torch.no_grad()
def test_graph_dump_writes_each_piece(tmp_path: os.PathLike[str]) -> None:
    net = WindowNet().eval()
    f = torch.compile(net, backend=_ro(split_ops=[WINDOW_SUM], **{"debug.graph_dump.type": "txt",
                                                                   "debug.graph_dump.path": str(tmp_path)}))
    x = torch.randn(3, 8)
    for n in (2, 3, 4):
        f(x, n)
    pieces = sorted(f for f in os.listdir(tmp_path) if "piece" in f)
    assert len(pieces) >= 2, os.listdir(tmp_path)
    assert all("ggtest.window_sum" not in open(os.path.join(tmp_path, p)).read() for p in pieces)


def test_training_through_a_split_matches_eager_gradients() -> None:
    torch.manual_seed(0)
    net, ref = WindowNet(), WindowNet()
    ref.load_state_dict(net.state_dict())
    f = torch.compile(net, backend=_ro(split_ops=[WINDOW_SUM]))
    for n in (2, 3, 2, 3, 2):
        x = torch.randn(3, 8)
        f(x, n).square().sum().backward()
        ref(x, n).square().sum().backward()
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, reduction=24, what=f"{name} n={n}")
            p.grad = q.grad = None
    # the backward needs n too, so n is part of the training graphs' key: each key is
    # captured whole (its n fixed), and the split op runs inside the capture
    fw, bw = _rec("forward"), _rec("backward")
    assert fw.captures == 2 and bw.captures == 2 and fw.pieces == [], str(graphgear.stats())


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 4])
def test_llama_decode_step_piecewise_matches_eager(batch: int) -> None:
    from graphgear.bench.models import build_model

    bm = build_model("llama")
    model, ref = bm.make(batch), bm.make(batch)
    f = torch.compile(model, backend=_ro(split_ops=[FLASH], **{"capture_config.mode": "piecewise"}))
    torch.manual_seed(1)
    with torch.no_grad():
        for pos in range(5):
            tok = torch.randint(0, bm.vocab_size, (batch, 1))
            p = torch.tensor([pos])
            assert_close(f(tok, p), ref(tok, p), reduction=4096, what=f"logits at {pos}")
    for i, (a, b) in enumerate(zip(model.cache.layers, ref.cache.layers)):
        assert_close(a.keys, b.keys, reduction=4096, what=f"layer {i} keys")
        assert_close(a.values, b.values, reduction=4096, what=f"layer {i} values")
    r = _rec()
    assert FLASH in [op for op, _ in r.splits] and r.fallbacks == []
    assert len(r.pieces) >= 3 and all(c == 1 for c, _ in _counts(r)), str(graphgear.stats())


@torch.no_grad()
@pytest.mark.parametrize("warmup", [0, 1])
def test_an_error_in_a_split_op_while_the_pieces_capture(warmup: int) -> None:
    """The split op raises on the call that captures piece 0 (before piece 1 ever
    captured): the cache write of piece 0 happened once, as in eager, and later calls
    capture and replay correctly."""
    torch.manual_seed(0)
    net, ref = CachedWindowNet(), CachedWindowNet()
    ref.load_state_dict(net.state_dict())
    f = torch.compile(net, backend=_ro(split_ops=[WINDOW_SUM], warmup_iters=warmup))
    x = torch.randn(1, 8)
    for p in range(warmup):
        assert_close(f(x, torch.tensor([p]), 2), ref(x, torch.tensor([p]), 2), reduction=32)
    for n in (3, 4):  # n=4: dynamo's graph with n as an input
        assert_close(f(x, torch.tensor([0]), n), ref(x, torch.tensor([0]), n), reduction=32)
    for n in (0, 9):
        with pytest.raises(ValueError, match=f"n={n} is outside"):
            f(x, torch.tensor([1]), n)
        with pytest.raises(ValueError, match=f"n={n} is outside"):
            ref(x, torch.tensor([1]), n)
        assert_close(net.cache, ref.cache, reduction=8, what=f"cache after n={n}")
    for p, n in [(2, 4), (3, 5), (1, 8)]:
        assert_close(f(x, torch.tensor([p]), n), ref(x, torch.tensor([p]), n), reduction=32, what=f"n={n}")
        assert_close(net.cache, ref.cache, reduction=8, what=f"cache n={n}")


# --------------------------------------------------------------------------------------
# data-dependent sizes: every node whose shape depends on an unbacked size runs uncaptured


def _dd_slice(x: torch.Tensor) -> torch.Tensor:
    k = (x > 0).sum().item()
    return torch.tanh(x) * x[:k].sum()


def _dd_masked_select(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * torch.masked_select(x, x > 0).sum()


def _dd_nonzero(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) + torch.nonzero(x > 0).sum()


def _dd_ones(x: torch.Tensor) -> torch.Tensor:
    k = (x > 0).sum().item()
    return torch.tanh(x) * torch.ones(k).sum()


@torch.no_grad()
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
@pytest.mark.parametrize("fn", [_dd_slice, _dd_masked_select, _dd_nonzero, _dd_ones],
                         ids=["slice", "masked_select", "nonzero", "ones"])
def test_a_data_dependent_size_is_never_frozen_in_a_piece(fn: object, mode: str) -> None:
    """The op that reads a tensor of a data-dependent size (the ``sum`` of ``x[:k]``) runs
    uncaptured, so a replay never reuses the ``k`` of the capture; ``k`` goes from 0 to
    the whole tensor across the calls."""
    assert callable(fn)
    f = torch.compile(fn, backend=_ro(mode), fullgraph=True)
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True), \
            warnings.catch_warnings():
        warnings.filterwarnings("error", message="graphgear")  # no fallback, no uncompiled piece
        for k in [3, 0, 11, 6, 1, 11, 0, 9]:
            x = -torch.rand(11) - 0.1
            x[:k] = torch.rand(k) + 0.1  # k positives, first (x[:k] is exactly them)
            before = x.clone()
            assert_close(f(x), fn(x), reduction=11, what=f"k={k}")
            assert torch.equal(x, before), "the input changed"
    r = _rec()
    assert r.fallbacks == [] and r.compiles == 1, str(graphgear.stats())
    if mode == "reduce-overhead":
        assert ("aten.sum", "reads a tensor whose shape depends on the data") in r.splits, r.splits
        assert len(r.pieces) >= 2 and all(c == 1 for c, _ in _counts(r)), str(graphgear.stats())


# --------------------------------------------------------------------------------------
# a listed torch.library op that writes its input (auto_functionalized in the graph)


@torch.no_grad()
@pytest.mark.parametrize("v2", [True, False], ids=["auto_functionalized_v2", "auto_functionalized"])
@pytest.mark.parametrize("layers", [0, 2], ids=["one_cache", "two_layers_of_one_cache"])
def test_a_listed_op_that_writes_its_input_is_cut_and_writes_the_real_cache(v2: bool, layers: int) -> None:
    """The op is a split node whatever AOTAutograd wraps it in; its int position is no
    part of the graph key (one compile, one capture per piece for every position); it
    writes the caller's cache itself (or the layer of it), never a clone; and a new
    cache (a new request) is used in place too. Cache and outputs equal eager after
    every call."""
    fn = write_two_layers if layers else write_then_read
    f = torch.compile(fn, backend=_ro(split_ops=[CACHE_WRITE]))
    shape = (layers, 4, 16, 4) if layers else (4, 16, 4)
    cache, ref = torch.zeros(shape), torch.zeros(shape)
    with torch._inductor.config.patch(enable_auto_functionalized_v2=v2), warnings.catch_warnings():
        warnings.filterwarnings("error", message="graphgear")  # no fallback, no per-value compiles
        for step in range(14):
            if step == 10:  # a new request: a new cache, filled as far as the old one
                cache, ref = cache.clone(), ref.clone()
            pos = step % 16
            x = torch.randn(4, 4)
            CACHE_WRITES.clear()
            out = f(x, cache, pos)
            # the first call's graph (pos fixed) is not cut: it runs whole. auto_functionalized
            # (v1, not torch's default) writes a view through a scatter into its base that
            # the graph reads after the write: that write stays on a clone (right, slower)
            if step > 0 and (v2 or not layers):
                want = [cache[i].data_ptr() for i in range(layers)] if layers else [cache.data_ptr()]
                assert CACHE_WRITES == want, f"step {step}: the op wrote a clone, not the cache"
            assert_close(out, fn(x, ref, pos), reduction=64, what=f"output at pos {pos}")
            assert_close(cache, ref, reduction=4, what=f"cache after pos {pos}")
    r = _rec()  # the first call's graph fixes pos; from the second on, pos is an input
    assert r.splits == [("ggtest.cache_write", "listed in capture_config.split_ops")], r.splits
    assert r.compiles == 1 and r.fallbacks == [], str(graphgear.stats())
    assert len(r.pieces) == (3 if layers else 2) and all(c == 1 for c, _ in _counts(r)), str(graphgear.stats())
    if v2 or not layers:
        assert all("aten.copy_" not in p.ops for p in r.pieces), "the split node wrote a clone, copied back"
    assert sum(g.compiles for g in graphgear.stats().graphs) == 2, str(graphgear.stats())


def _write_graph(read_old_after: bool) -> torch.fx.GraphModule:
    """AOTAutograd's form of ``cache_write(cache, kv, 2)`` followed by a read of the new
    cache, and (``read_old_after``) a read of the old cache placed after the write, as a
    scheduling pass may leave it: then the write must not go to the cache itself."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2

    aten = torch.ops.aten
    g = torch.fx.Graph()
    cache, kv = g.placeholder("cache"), g.placeholder("kv")
    af = g.call_function(auto_functionalized_v2, (torch.ops.ggtest.cache_write.default,),
                         {"kv": kv, "pos": 2, "_cache_base_index": 0, "_all_bases": [cache]})
    new = g.call_function(operator.getitem, (af, 1))
    out = g.call_function(aten.sum.dim_IntList, (new, [1]))
    if read_old_after:
        out = g.call_function(aten.add.Tensor, (out, g.call_function(aten.sum.default, (cache,))))
    g.call_function(aten.copy_.default, (cache, new))
    g.output((out,))
    return torch.fx.GraphModule(torch.nn.Module(), g)


@torch.no_grad()
@pytest.mark.parametrize("read_old_after", [False, True])
def test_a_split_write_goes_to_the_input_only_where_nothing_reads_the_old_values(read_old_after: bool) -> None:
    from graphgear._torch.fx import fake_values
    from graphgear.capture.split import writes_in_place

    def run(gm: torch.fx.GraphModule) -> tuple[torch.Tensor, torch.Tensor]:
        cache = torch.arange(24.0).view(3, 8)
        out = gm(cache, torch.full((3,), -1.0))[0]
        return out, cache

    gm = _write_graph(read_old_after)
    want = run(gm)  # the functional graph, as AOTAutograd made it: right by construction
    fake_values(gm, [torch.zeros(3, 8), torch.zeros(3)])
    split = {n for n in gm.graph.nodes if "auto_functionalized" in str(n.target)}
    new_gm, new_split = writes_in_place(gm, split)
    assert len(new_split) == 1
    in_place = new_gm is not gm
    assert in_place == (not read_old_after), new_gm.code
    if in_place:
        assert "copy_" not in new_gm.code and "auto_functionalized_v2(" not in new_gm.code, new_gm.code
    got = run(new_gm)
    assert_close(got[0], want[0], what="output")
    assert_close(got[1], want[1], what="cache")


# --------------------------------------------------------------------------------------
# split_ops names: each must name an op


@pytest.mark.parametrize(("name", "closest"), [
    ("aten.mmm", "the closest known op is 'aten.mm'"),
    ("ggtest::window_su", "the closest known op is 'ggtest::window_sum'"),  # a custom op, misspelt
    ("ggtest.window_sum.defualt", "has no overload 'defualt'; its overloads: default"),
    ("torch.mm", "is a Python name of torch, not an op.*the op of that name is 'aten.mm'"),
    ("mm", "not of the form 'namespace.op'.*the op of that name is 'aten.mm'"),
    ("atne.mm", "no op is registered in namespace 'atne'; the closest known op is 'aten.mm'"),
])
def test_a_split_ops_name_of_no_op_is_a_config_error_naming_the_closest(name: str, closest: str) -> None:
    cfg = graphgear.CompilerConfig()
    with pytest.raises(graphgear.ConfigError, match=rf"capture_config.split_ops.*'{name}'.*{closest}"):
        cfg.capture_config.split_ops = ["aten.mm", name]
    assert cfg.capture_config.split_ops == ()  # the bad value was not stored
    with pytest.raises(graphgear.ConfigError, match=closest):
        _ro(split_ops=[name])  # options= takes the same path


@torch.no_grad()
def test_split_ops_takes_torch_ops_paths_as_op_names() -> None:
    cfg = graphgear.CompilerConfig()
    cfg.capture_config.split_ops = ["torch.ops.aten.mm", "torch.ops.ggtest.window_sum.default", "aten::addmm"]
    assert cfg.capture_config.split_ops == ("aten.mm", "ggtest.window_sum.default", "aten::addmm")

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(x) @ x)

    g = torch.compile(f, backend=_ro(split_ops=["torch.ops.aten.mm"], **{"capture_config.mode": "piecewise"}))
    for _ in range(3):
        x = torch.randn(4, 4)
        assert_close(g(x), f(x), reduction=4)
    assert _rec().splits == [("aten.mm", "listed in capture_config.split_ops")]


@torch.no_grad()
def test_a_split_op_of_a_namespace_registered_later_is_checked_when_compiling(
        caplog: pytest.LogCaptureFixture) -> None:
    """A namespace no op is registered in yet is accepted when set (its module may be
    imported later) and checked when a graph compiles: a ConfigError naming it while it
    is still unknown; once registered, the graph is cut there. A known op a graph does not
    hold costs one debug line."""
    cfg = graphgear.CompilerConfig()
    cfg.mode = "reduce-overhead"
    cfg.capture_config.split_ops = ["ggtest_later::scale", "aten.mm"]

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) + 1

    with pytest.raises(Exception) as info:
        torch.compile(f, backend=graphgear.get_backend(compiler_config=cfg))(torch.randn(4))
    err = graphgear.errors.graphgear_error(info.value)
    assert isinstance(err, graphgear.ConfigError), info.value
    assert "'ggtest_later::scale' names no registered op" in str(err), str(err)

    @torch.library.custom_op("ggtest_later::scale", mutates_args=())
    def scale(x: torch.Tensor, n: int) -> torch.Tensor:
        return x * n

    @scale.register_fake
    def _(x: torch.Tensor, n: int) -> torch.Tensor:
        return torch.empty_like(x)

    def g(x: torch.Tensor, n: int) -> torch.Tensor:
        return torch.tanh(scale(torch.tanh(x), n)) + 1

    graphgear.reset()
    h = torch.compile(g, backend=graphgear.get_backend(compiler_config=cfg))
    with caplog.at_level("DEBUG", logger="graphgear.compilers.reduce_overhead"):
        for n in range(1, 5):
            x = torch.randn(4)
            assert_close(h(x, n), g(x, n), reduction=4)
    assert _rec().splits == [("ggtest_later.scale", "listed in capture_config.split_ops")]
    absent = [r.getMessage() for r in caplog.records if "holds no node of split_ops" in r.getMessage()]
    assert absent and all("['aten.mm']" in m for m in absent), absent

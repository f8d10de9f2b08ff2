"""reduce-overhead on the CPU: every rule of "reduce-overhead semantics", with counters.

Most tests use one tiny module (``Net``) so the CPU graph's Inductor compile is a cache
hit after the first; ``_ro`` builds a reduce-overhead backend with capture options.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import graphgear
from graphgear.capture import CaptureEngine, MemoryPool, find_uncapturable
from tests.helpers import assert_close, make_config
from tests.helpers import last_record as _rec
from tests.helpers import make_backend as _ro
from tests.models import Net

pytestmark = pytest.mark.inductor


class Cache(nn.Module):
    """Writes its input into a buffer in place (a one-slot KV cache) and reads it back."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(4, 8))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos, self.lin(x))
        return self.cache.sum(0, keepdim=True) * 1.5


def _engines() -> list[CaptureEngine]:
    """The capture engines of the graphs compiled in this test, in compile order."""
    import gc

    recs = [id(g) for g in graphgear.stats().graphs]
    found = [o for o in gc.get_objects() if type(o) is CaptureEngine and id(o.record) in recs]
    return sorted(found, key=lambda e: (recs.index(id(e.record)), e.serial))


@torch.no_grad()
def test_warmup_capture_replay_counts_and_values() -> None:
    net = Net()
    f = torch.compile(net, backend=_ro())
    xs = [torch.randn(2, 8) for _ in range(5)]
    outs = [f(x).clone() for x in xs]
    for x, o in zip(xs, outs):
        assert_close(o, net(x), reduction=8)
    r = _rec()
    assert (r.uncaptured_runs, r.captures, r.replays) == (1, 1, 3)
    assert r.pool_bytes > 0 and r.fallbacks == []


@torch.no_grad()
@pytest.mark.parametrize("warmup", [0, 3])
def test_warmup_iters(warmup: int) -> None:
    f = torch.compile(Net(), backend=_ro(warmup_iters=warmup))
    for _ in range(5):
        f(torch.randn(2, 8))
    r = _rec()
    assert (r.uncaptured_runs, r.captures, r.replays) == (warmup, 1, 5 - warmup - 1)


@torch.no_grad()
def test_user_inputs_copied_into_static_buffers() -> None:
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    f(torch.randn(2, 8))
    eng = _engines()[-1]
    (entry,) = eng.entries.values()
    bound = entry.graph.args[eng.copy_idx[0]]
    x = torch.randn(2, 8)
    out = f(x)
    assert bound.data_ptr() != x.data_ptr()
    assert_close(bound, x)  # the replay read a copy of x
    assert_close(out, net(x), reduction=8)
    assert _rec().captures == 1 and _rec().replays == 1


@torch.no_grad()
def test_clone_input_false_binds_inputs_and_rebinds_when_they_move() -> None:
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0, clone_input=False))
    x = torch.randn(2, 8)
    f(x)
    x.copy_(torch.randn(2, 8))  # same address: replayed in place, no copy
    assert_close(f(x), net(x), reduction=8)
    assert (_rec().captures, _rec().replays) == (1, 1)
    y = torch.randn(2, 8)  # a new address: the CPU graph rebinds it (no new capture)
    assert_close(f(y), net(y), reduction=8)
    assert_close(f(x), net(x), reduction=8)
    assert (_rec().captures, _rec().rebinds, _rec().replays) == (1, 2, 3)


@torch.no_grad()
def test_static_parameters_not_copied_and_address_is_part_of_the_key() -> None:
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    x = torch.randn(2, 8)
    f(x)
    net.lin.weight.add_(1.0)  # in place: the bound parameter sees it, no new capture
    assert_close(f(x), net(x), reduction=8)
    assert _rec().captures == 1
    eng = _engines()[-1]
    assert eng.static_idx and not set(eng.static_idx) & set(eng.copy_idx)
    (entry,) = eng.entries.values()
    assert entry.graph.args[eng.static_idx[0]] is not None
    assert {entry.graph.args[i].data_ptr() for i in eng.static_idx} >= {net.lin.weight.data_ptr()}


@torch.no_grad()
@pytest.mark.parametrize("frozen", [False, True])
def test_moved_parameter_recaptures_unless_frozen(frozen: bool) -> None:
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0, frozen_parameter=frozen))
    x = torch.randn(2, 8)
    f(x)
    moved = net.lin.weight.detach().clone() + 1
    net.lin.weight.data = moved  # same Parameter object, new address
    out = f(x).clone()
    caps = sum(g.captures for g in graphgear.stats().graphs)
    if frozen:  # the address is promised fixed: left out of the key, no new capture
        assert caps == 1
    else:
        assert caps == 2
        assert_close(out, net(x), reduction=8)


@torch.no_grad()
def test_mutated_input_used_in_place_and_rebound_when_it_moves() -> None:
    torch.manual_seed(0)
    net, ref = Cache(), Cache()
    ref.load_state_dict(net.state_dict())
    f = torch.compile(net, backend=_ro(warmup_iters=1))
    for p in range(4):
        x = torch.randn(1, 8)
        assert_close(f(x, torch.tensor([p])), ref(x, torch.tensor([p])), reduction=8)
        assert_close(net.cache, ref.cache, reduction=8)  # written in place, never a copy
    eng = _engines()[-1]
    assert eng.mutated_idx and not set(eng.mutated_idx) & set(eng.copy_idx)
    r = _rec()
    assert (r.uncaptured_runs, r.captures, r.replays) == (1, 1, 2)
    net.cache = torch.zeros(4, 8)  # the cache moves: rebound (no new capture), same results
    ref.cache = torch.zeros(4, 8)
    x = torch.randn(1, 8)
    assert_close(f(x, torch.tensor([1])), ref(x, torch.tensor([1])), reduction=8)
    assert_close(net.cache, ref.cache, reduction=8)
    assert sum(g.captures for g in graphgear.stats().graphs) == 1
    assert sum(g.rebinds for g in graphgear.stats().graphs) == 1


@torch.no_grad()
def test_stale_output_raises_and_names_the_fix() -> None:
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    out1 = f(x1)
    kept = out1.clone()
    view1 = out1[0]
    out2 = f(x2)
    for stale in (out1, view1):
        with pytest.raises(RuntimeError, match="overwritten") as info:
            stale + 0
        assert "clone_output" in str(info.value) and "clone()" in str(info.value)
    with pytest.raises(RuntimeError, match="overwritten"):
        out1.tolist()
    assert_close(kept, net(x1), reduction=8)
    assert_close(out2, net(x2), reduction=8)
    out3 = f(x1)  # out2 is stale now; out3 is valid
    with pytest.raises(RuntimeError, match="overwritten"):
        out2 + 0
    assert_close(out3, net(x1), reduction=8)


@torch.no_grad()
def test_clone_output_returns_fresh_tensors() -> None:
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0, clone_output=True))
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    out1, out2 = f(x1), f(x2)
    assert_close(out1, net(x1), reduction=8)
    assert_close(out2, net(x2), reduction=8)
    assert out1.data_ptr() != out2.data_ptr()


@torch.no_grad()
def test_cpu_graph_replay_reuses_the_recorded_memory() -> None:
    f = torch.compile(Net(), backend=_ro(warmup_iters=0))
    f(torch.randn(2, 8))
    eng = _engines()[-1]
    (entry,) = eng.entries.values()
    g = entry.graph
    assert g.native and g.record, "the CPU graph should run Inductor code on a recorded arena"
    ptrs = [t.data_ptr() for t in g.record]
    o1 = g.replay()[0].data_ptr()
    o2 = g.replay()[0].data_ptr()
    assert o1 == o2 and o1 in {t.untyped_storage().data_ptr() for t in g.record} | set(ptrs)
    assert [t.data_ptr() for t in g.record] == ptrs


def _dyn(backend: object) -> object:
    return torch.compile(Net(), backend=backend, dynamic=True)


@torch.no_grad()
def test_one_capture_per_graph_key_and_capture_limit_warns_once() -> None:
    torch.manual_seed(0)
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0, capture_limit=2), dynamic=True)
    for n in (3, 5, 3, 5):
        x = torch.randn(n, 8)
        assert_close(f(x), net(x), reduction=8)
    r = _rec()
    assert (r.captures, r.replays) == (2, 2)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for n in (6, 7, 6):
            x = torch.randn(n, 8)
            assert_close(f(x), net(x), reduction=8)
    limit = [x for x in w if "capture_limit" in str(x.message)]
    assert len(limit) == 1, [str(x.message) for x in w]
    assert "raise capture_limit" in str(limit[0].message)
    r = _rec()
    assert r.captures == 2 and r.uncaptured_runs == 3
    assert any(op == "capture_limit" for op, _ in r.fallbacks)


@torch.no_grad()
@pytest.mark.parametrize("share", [True, False])
def test_pool_shared_across_keys(share: bool) -> None:
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0, reuse_pool_across_gears=share), dynamic=True)
    x3, x5 = torch.randn(3, 8), torch.randn(5, 8)
    a = f(x3)
    b = f(x5)
    engines = _engines()[-2:]
    pools = {id(e.pool) for e in engines}
    graphs = [next(iter(e.entries.values())).graph for e in engines]
    inputs = (3 + 5) * 8 * 4  # the two static input buffers, float32
    if share:  # one pool: key 5's replay overwrote key 3's output
        assert len(pools) == 1
        assert engines[0].pool.nbytes < sum(g.nbytes for g in graphs) + inputs
        with pytest.raises(RuntimeError, match="overwritten"):
            a + 0
    else:
        assert len(pools) == 2
        assert all(e.pool.nbytes >= g.nbytes > 0 for e, g in zip(engines, graphs))
        assert_close(a, net(x3), reduction=8)  # its own memory: still valid
    assert_close(b, net(x5), reduction=8)
    assert graphgear.stats().graphs[-1].pool_bytes > 0
    for x in (x3, x5, x3):  # after the block grew, both captures still compute right
        assert_close(f(x), net(x), reduction=8)
    assert sum(g.captures for g in graphgear.stats().graphs) == 2


@torch.no_grad()
def test_custom_pool_shared_by_two_models() -> None:
    pool = MemoryPool()
    n1, n2 = Net(), Net()
    f1 = torch.compile(n1, backend=_ro(warmup_iters=0, use_custom_pool=pool))
    f2 = torch.compile(n2, backend=_ro(warmup_iters=0, use_custom_pool=pool))
    x = torch.randn(2, 8)
    o1 = f1(x)
    assert pool.nbytes > 0
    first = pool.nbytes
    o2 = f2(x)
    assert pool.nbytes < 2 * first + 1024  # the second model reuses the first's blocks
    assert all(e.pool is pool for e in _engines()[-2:])
    with pytest.raises(RuntimeError, match="overwritten"):
        o1 + 0
    assert_close(o2, n2(x), reduction=8)


class _Wide(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * 2


def test_a_pool_shared_by_models_captured_under_no_grad_and_inference_mode() -> None:
    """Each model's capture grows the shared pool's blocks, which moves the earlier
    models' buffers to the larger blocks (``set_``). Buffers captured under
    ``inference_mode`` are inference tensors, which refuse ``set_`` outside it: the
    growth under ``no_grad`` failed the capture (the model then ran uncaptured), and
    with a block holding both kinds it could stop halfway, splitting a capture's
    buffers between two blocks. Every model captures and stays right."""
    pool = MemoryPool()
    nets = [_Wide(d) for d in (8, 32, 64)]
    modes = [torch.no_grad, torch.inference_mode, torch.no_grad]
    fns = [torch.compile(n, backend=_ro(warmup_iters=0, use_custom_pool=pool)) for n in nets]
    xs = [torch.randn(4 * (i + 1), n.a.in_features) for i, n in enumerate(nets)]
    for _ in range(2):
        for f, n, x, mode in zip(fns, nets, xs, modes):
            with mode():
                assert_close(f(x).clone(), n(x), reduction=x.shape[1])
    recs = graphgear.stats().graphs
    assert [(r.captures, r.replays, r.fallbacks) for r in recs] == [(1, 1, [])] * 3, str(graphgear.stats())


def _nonzero_graph() -> torch.fx.GraphModule:
    return make_fx(lambda x: torch.nonzero(x * 2))(torch.tensor([0.0, 1.0, 2.0]))


def _rand_graph() -> torch.fx.GraphModule:
    return make_fx(lambda x: x + torch.rand_like(x))(torch.zeros(3))


@pytest.mark.parametrize("make, op", [(_nonzero_graph, "aten.nonzero"), (_rand_graph, "aten.rand_like")])
def test_uncapturable_falls_back_to_eager_with_reason(make: object, op: str) -> None:
    config = graphgear.CompilerConfig()
    config.mode = "reduce-overhead"
    config.capture_config.split_uncapturable = False  # no piecewise cut: the whole graph falls back
    gm = make()  # type: ignore[operator]
    with pytest.warns(UserWarning, match=rf"{op}.*split_uncapturable=True"):
        fn = graphgear.get_compiler(config)(gm, [torch.zeros(3)])
    x = torch.tensor([0.0, 1.0, 2.0])
    out = fn(x)
    if op == "aten.nonzero":
        assert out[0].tolist() == [[1], [2]] if isinstance(out, tuple | list) else out.tolist() == [[1], [2]]
    r = _rec()
    assert [o for o, _ in r.fallbacks] == [op] and r.captures == 0 and r.uncaptured_runs == 1
    assert r.fallbacks[0][1]  # the reason is named


def test_uncapturable_raises_with_fallback_raise() -> None:
    config = graphgear.CompilerConfig()
    config.mode = "reduce-overhead"
    config.capture_config.fallback = "raise"
    config.capture_config.mode = "full"  # captured whole or not at all
    with pytest.raises(graphgear.CaptureError, match="aten.nonzero.*data.*mode='full_and_piecewise'"):
        graphgear.get_compiler(config)(_nonzero_graph(), [torch.zeros(3)])


@torch.no_grad()
def test_item_in_graph_falls_back_without_a_split() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * x.sum().long().item()

    f = torch.compile(fn, backend=_ro(split_uncapturable=False), fullgraph=True)
    with torch._dynamo.config.patch(capture_scalar_outputs=True), \
            pytest.warns(UserWarning, match=r"_local_scalar_dense.*: capture_config.split_uncapturable=True "
                                            r"\(or split_ops=\['aten._local_scalar_dense'\]\)"):
        out = f(torch.ones(3))
    assert_close(out, torch.full((3,), 3.0))
    assert any(op == "aten._local_scalar_dense" for op, _ in _rec().fallbacks)


def test_cpu_work_in_a_device_graph_is_detected() -> None:
    gm = make_fx(lambda x: (x * 2).sum(0))(torch.ones(4, 3))
    found = find_uncapturable(gm, torch.device("cuda"))
    assert found and all("CPU inside a CUDA graph" in why for _, why in found)
    assert find_uncapturable(gm, torch.device("cpu")) == []
    rand = _rand_graph()  # RNG is graph-safe on CUDA only
    assert not [r for _, r in find_uncapturable(rand, torch.device("cuda")) if "random" in r]
    assert find_uncapturable(rand, torch.device("cpu"))


@torch.no_grad()
def test_reset_releases_and_the_function_recaptures() -> None:
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    x = torch.randn(2, 8)
    out = f(x)
    graphgear.reset()
    with pytest.raises(RuntimeError, match="released"):
        out + 0
    assert_close(f(x), net(x), reduction=8)
    assert _rec().captures == 1


def test_training_gradients_equal_eager() -> None:
    torch.manual_seed(0)
    net, ref = Net(), Net()
    ref.load_state_dict(net.state_dict())
    f = torch.compile(net, backend=_ro(warmup_iters=1))
    opt, ref_opt = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(4):
        x = torch.randn(2, 8)
        loss, ref_loss = f(x).square().mean(), ref(x).square().mean()
        loss.backward()
        ref_loss.backward()
        for p, q in zip(net.parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, reduction=16)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert_close(loss, ref_loss, reduction=16)
    fw, bw = _rec("forward"), _rec("backward")
    assert (fw.captures, fw.replays, bw.captures, bw.replays) == (1, 2, 1, 2)


@torch.no_grad()
def test_toy_decoder_greedy_decode_matches_eager() -> None:
    from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder

    cfg = DecoderConfig(vocab_size=64, hidden_size=32, num_layers=1, intermediate_size=64, max_seq_len=16,
                        max_batch_size=1)
    torch.manual_seed(0)
    model, ref = ToyDecoder(cfg).eval(), ToyDecoder(cfg).eval()
    ref.load_state_dict(model.state_dict())
    f = torch.compile(model, backend=_ro())
    tok = ref_tok = torch.tensor([[1]])
    got, want = [], []
    for p in range(10):
        tok = f(tok, torch.tensor([p]))[:, -1:].argmax(-1)
        ref_tok = ref(ref_tok, torch.tensor([p]))[:, -1:].argmax(-1)
        got.append(tok.item())
        want.append(ref_tok.item())
    assert got == want
    r = _rec()
    assert (r.uncaptured_runs, r.captures, r.replays) == (1, 1, 8)


@torch.no_grad()
@pytest.mark.parametrize("fallback", ["eager", "raise"])
def test_capture_failure_follows_fallback(fallback: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from graphgear.capture import cpu_graph

    def broken(self: object, args: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(cpu_graph.CPUGraph, "capture", broken)
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0, fallback=fallback))
    x = torch.randn(2, 8)
    if fallback == "raise":
        with pytest.raises(graphgear.CaptureError, match="not permitted.*fallback='eager'"):
            f(x)
    else:
        with pytest.warns(UserWarning, match="runs uncaptured"):
            assert_close(f(x), net(x), reduction=8)
        assert_close(f(x), net(x), reduction=8)
        r = _rec()
        assert (r.captures, r.uncaptured_runs) == (0, 2)
        assert r.fallbacks and r.fallbacks[0][0] == "capture" and "not permitted" in r.fallbacks[0][1]


class _Position:
    """A plain object holding a Python int, as transformers' sliding-window cache layer
    holds ``cumulative_length_int``."""

    def __init__(self) -> None:
        self.n = 0


class _Stepper(nn.Module):
    """Advances the int of the state it is given every call; with ``scale`` it also
    multiplies by it (a tensor depends on it)."""

    def __init__(self, scale: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = scale

    def forward(self, x: torch.Tensor, pos: _Position) -> torch.Tensor:
        pos.n += 1
        y = self.lin(x).relu()
        return y * pos.n if self.scale else y + 1


@torch.no_grad()
@pytest.mark.parametrize("scale", [False, True])
def test_a_python_int_the_graph_only_advances_is_one_key(scale: bool) -> None:
    """dynamo turns an object's int that changes every call into a SymInt input; where no
    tensor depends on it (the graph only returns it plus one), every value runs one key:
    one compile and one capture, not one per value (seconds each). Where a tensor does
    depend on it, each value is a key of its own, as before. Values equal eager's, and
    the int advances as in eager."""
    model, ref = _Stepper(scale), _Stepper(scale)
    ref.load_state_dict(model.state_dict())
    f = torch.compile(model, backend=_ro())
    mine, theirs = _Position(), _Position()
    for _ in range(8):
        x = torch.randn(2, 8)
        assert_close(f(x, mine), ref(x, theirs), reduction=8)
    assert mine.n == theirs.n == 8
    graphs = graphgear.stats().graphs
    assert len(graphs) == 2, str(graphgear.stats())  # the first value static, then dynamic
    dynamic = graphs[1]
    if scale:
        # a key per value (each warms up once): the CPU graph compiles each ("auto" compile_sizes)
        assert dynamic.compiles == 7, str(graphgear.stats())
    else:
        assert dynamic.compiles == dynamic.captures == 1, str(graphgear.stats())
        assert dynamic.replays == 5


@torch.no_grad()
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_a_python_int_that_reaches_values_stops_compiling_after_a_few_values(mode: str) -> None:
    """An int that changes every call and reaches a tensor's values is a graph key per
    value: a compile per call (seconds each; torch.compile makes it dynamic instead).
    Past SCALAR_KEYS values per shape, new values run the graph uncompiled, with one
    warning naming the input and the fix; every result equals eager's."""
    from graphgear.dispatch import SCALAR_KEYS

    model, ref = _Stepper(True), _Stepper(True)
    ref.load_state_dict(model.state_dict())
    gears = {0: [2, 4]}
    f = torch.compile(model, backend=_ro(mode))
    mine, theirs = _Position(), _Position()
    with pytest.warns(UserWarning, match="took more than 8 values") as caught:
        for i in range(SCALAR_KEYS + 12):
            x = torch.randn(2 if i % 2 else 4, 8)
            graphgear.set_dim_gears(x, gears)
            assert_close(f(x, mine), ref(x, theirs), reduction=8)
    assert mine.n == theirs.n == SCALAR_KEYS + 12
    assert sum("took more than" in str(w.message) for w in caught) == 1
    dynamic = graphgear.stats().graphs[-1]
    assert dynamic.compiles <= 2 * SCALAR_KEYS, str(graphgear.stats())  # two shapes
    assert dynamic.uncaptured_runs >= 2 and any("Python int" in f[1] for f in dynamic.fallbacks)


@torch.no_grad()
def test_expanded_input_is_copied_densely() -> None:
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    for _ in range(3):
        x = torch.randn(1, 8).expand(4, 8)  # stride 0: cannot be the layout of a buffer
        assert_close(f(x), net(x), reduction=8)
    assert (_rec().captures, _rec().replays) == (1, 2)


def test_data_dependent_control_flow_is_not_captured() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda t: t + 1, lambda t: t - 1, (x,))

    f = torch.compile(fn, backend=_ro(warmup_iters=0), fullgraph=True)
    with pytest.warns(UserWarning, match="cond"):
        out = f(torch.ones(3))
    assert_close(out, torch.full((3,), 2.0))
    assert_close(f(-torch.ones(3)), torch.full((3,), -2.0))
    assert any(op == "cond" for op, _ in _rec().fallbacks)


@torch.no_grad()
def test_one_capture_per_gear_with_padding() -> None:
    net = Net()
    config = graphgear.CompilerConfig()
    config.mode = "reduce-overhead"
    config.capture_config.warmup_iters = 0
    config.inference_config.gear_padding = True
    f = torch.compile(net, backend=graphgear.get_backend(config))
    sizes = [2, 3, 4, 5, 2, 4, 8, 7]  # gears 2, 4, 8: 3 pads to 4, 5 and 7 to 8
    for n in sizes:
        x = torch.randn(n, 8)
        graphgear.set_dim_gears(x, {0: [2, 4, 8]})
        out = f(x)
        assert out.shape == (n, 8)
        assert_close(out, net(x), reduction=8)
    r = _rec()
    assert r.captures == 3 and r.replays == len(sizes) - 3 and r.uncaptured_runs == 0


class _FakeStream:
    def __init__(self, device: object = None) -> None:
        pass

    def wait_stream(self, other: object) -> None:
        pass


class _FakeCudaModule:
    """Just enough of ``torch.cuda`` for the CUDA graph's life cycle on the CPU."""

    Stream = _FakeStream

    @staticmethod
    def stream(s: object) -> object:
        import contextlib

        return contextlib.nullcontext()

    @staticmethod
    def current_stream(device: object = None) -> _FakeStream:
        return _FakeStream()

    @staticmethod
    def synchronize(device: object = None) -> None:
        pass

    @staticmethod
    def memory_allocated(device: object = None) -> int:
        return 0


class _FakeGraph:
    def __init__(self) -> None:
        self.fn: object = None
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.fn()  # type: ignore[operator]

    def reset(self) -> None:
        self.fn = None


def _fake_cuda_graph_class() -> type:
    """``CUDAGraph`` whose capture has no side effects (inputs it mutates are restored, as
    a real capture does not run kernels) and whose replay re-runs the recorded callable
    into the captured outputs: the CUDA graph class's own logic, exercised on the CPU."""
    import contextlib

    from graphgear.capture.cuda_graph import CUDAGraph

    class FakeCUDAGraph(CUDAGraph):
        def _mod(self) -> object:
            return _FakeCudaModule

        def _new_graph(self) -> _FakeGraph:
            return _FakeGraph()

        def _graph_ctx(self, graph: _FakeGraph, pool: object, stream: object) -> object:
            @contextlib.contextmanager
            def ctx():  # type: ignore[no-untyped-def]
                args = list(self.args)  # a real graph holds the addresses, not the tensors
                saved = {i: args[i].clone() for i in self.mutated_idx}
                yield
                for i, t in saved.items():
                    args[i].copy_(t)

                def replay() -> None:
                    new = self.run(list(args))
                    for o, n in zip(self.outputs, new):
                        o.copy_(n)

                graph.fn = replay

            return ctx()

    return FakeCUDAGraph


@torch.no_grad()
def test_cuda_graph_life_cycle_with_a_fake_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from graphgear.capture import devices, split
    from graphgear.compilers import reduce_overhead as capture

    fake = _fake_cuda_graph_class()
    monkeypatch.setattr(capture, "graph_device", lambda inputs: torch.device("cuda"))
    # the graph's ops run on the CPU: on a real CUDA device they would be split points
    monkeypatch.setattr(split, "node_uncapturable", lambda node, device: None)
    monkeypatch.setattr(devices, "DEVICE_KINDS",
                        {**devices.DEVICE_KINDS, "cuda": dataclasses.replace(devices.DEVICE_KINDS["cuda"], graph=fake)})
    torch.manual_seed(0)
    net, ref = Cache(), Cache()
    ref.load_state_dict(net.state_dict())
    pool = MemoryPool(pool_id=(0, 1))
    f = torch.compile(net, backend=_ro(warmup_iters=1, use_custom_pool=pool))
    outs = []
    for p in range(4):
        x = torch.randn(1, 8)
        outs.append(f(x, torch.tensor([p])))
        assert_close(outs[-1], ref(x, torch.tensor([p])), reduction=8)
        assert_close(net.cache, ref.cache, reduction=8)  # warm-up and capture left no trace
    r = _rec()
    assert (r.uncaptured_runs, r.captures, r.replays) == (1, 1, 2)
    (eng,) = _engines()
    (entry,) = eng.entries.values()
    assert type(entry.graph) is fake and entry.graph.graph.replays == 3  # capture call + 2
    with pytest.raises(RuntimeError, match="overwritten"):
        outs[-2] + 0
    graphgear.reset()
    with pytest.raises(RuntimeError, match="overwritten|released"):
        outs[-1] + 0


def test_toy_decoder_training_gradients_equal_eager() -> None:
    from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder

    cfg = DecoderConfig(vocab_size=64, hidden_size=32, num_layers=1, intermediate_size=64, max_seq_len=16,
                        max_batch_size=2)
    torch.manual_seed(0)
    model, ref = ToyDecoder(cfg), ToyDecoder(cfg)
    ref.load_state_dict(model.state_dict())
    f = torch.compile(model, backend=_ro())
    for _ in range(4):
        tok, pos = torch.randint(0, 64, (2, 4)), torch.arange(4)
        model.reset_cache()
        ref.reset_cache()
        f(tok, pos).square().mean().backward()
        ref(tok, pos).square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, reduction=4096, what=name)
            p.grad = q.grad = None
    fw, bw = _rec("forward"), _rec("backward")
    assert (fw.uncaptured_runs, fw.captures, fw.replays) == (1, 1, 2)
    assert (bw.uncaptured_runs, bw.captures, bw.replays) == (1, 1, 2)


@torch.no_grad()
@pytest.mark.parametrize("batch", [1, 4])
def test_frozen_parameters_are_packed_constants_and_match_eager(batch: int) -> None:
    """frozen_parameter on the CPU graph: weights become constants of the compiled code
    (packed for the C++ GEMM template), inputs stay inputs; results equal eager."""
    from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder

    cfg = DecoderConfig(vocab_size=64, hidden_size=32, num_layers=1, intermediate_size=64,
                        max_seq_len=16, max_batch_size=4)
    model, ref = ToyDecoder(cfg).eval(), ToyDecoder(cfg).eval()
    ref.load_state_dict(model.state_dict())
    f = torch.compile(model, backend=_ro(frozen_parameter=True))
    tok = ref_tok = torch.arange(1, batch + 1).view(batch, 1)
    for p in range(5):
        out, want = f(tok, torch.tensor([p])), ref(ref_tok, torch.tensor([p]))
        assert_close(out, want, reduction=64)
        tok, ref_tok = out[:, -1:].argmax(-1), want[:, -1:].argmax(-1)
    (eng,) = [e for e in _engines() if e.entries]
    (ex,) = eng.executor.made
    assert ex.native and hasattr(ex.run, "__wrapped__")  # weights are constants: args dropped
    r = _rec()
    assert (r.captures, r.fallbacks) == (1, [])
    assert_close(model.layers[0].attn.k_cache, ref.layers[0].attn.k_cache, reduction=64)


@torch.no_grad()
@pytest.mark.parametrize("batch", [1, 4, 20])
def test_frozen_weights_are_keyed_by_shape_and_each_model_keeps_its_own(batch: int) -> None:
    """Frozen weights are constants of the compiled code; Inductor's cache keys them by
    shape, not value (hashing a real vocabulary's weights by value took minutes), so a
    second model of the same shapes loads the first one's code from the cache. Each must
    still compute with its own weights: one row (Inductor's loops and, past 2048 wide,
    graphgear's packed product), 4 rows (graphgear's packed product), 20 rows (MKL's
    packed products through the C++ wrapper: Inductor does not cache a graph holding
    MKL's packed weights at all, it compiles it again)."""
    from torch._dynamo.utils import counters

    def mlp() -> nn.Module:  # fresh random weights every run: never in the disk cache
        return nn.Sequential(nn.Linear(16, 2100), nn.GELU(), nn.Linear(2100, 32), nn.GELU(), nn.Linear(32, 32),
                             nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16)).eval()

    a, b = mlp(), mlp()
    fa = torch.compile(a, backend=_ro(warmup_iters=0, frozen_parameter=True))
    fb = torch.compile(b, backend=_ro(warmup_iters=0, frozen_parameter=True))
    x = torch.randn(batch, 16)
    assert_close(fa(x), a(x), reduction=2100, what="first model")
    before = dict(counters["inductor"])
    assert_close(fb(x), b(x), reduction=2100, what="second model")
    grew = {k for k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
            if counters["inductor"][k] > before.get(k, 0)}
    assert grew == ({"fxgraph_cache_bypass"} if batch > 16 else {"fxgraph_cache_hit"}), grew
    for _ in range(2):  # each replays on its own constants
        y = torch.randn(batch, 16)
        assert_close(fa(y), a(y), reduction=2100, what="first model, after the second")
        assert_close(fb(y), b(y), reduction=2100, what="second model, after the first")


class _Scaled(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(16, 2100)
        self.out = nn.Linear(2100, 8)
        self.scale = nn.Parameter(torch.tensor(float(seed + 1)))  # a learnt scale: 0-d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lin(x).relu()) * self.scale


@torch.no_grad()
def test_frozen_scalar_parameters_stay_each_models_own() -> None:
    """Inductor writes a 0-d constant's value into the generated code; a second served
    model of the same shapes must not be served the first one's code from Inductor's
    cache (which keys frozen weights by shape) with the first one's scale."""
    class Scaled(nn.Module):
        def __init__(self, scale: float) -> None:
            super().__init__()
            self.lin = nn.Linear(32, 32)
            self.scale = nn.Parameter(torch.tensor(scale))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    a, b = Scaled(1.0).eval(), Scaled(2.0).eval()
    fa, fb = graphgear.inference.serve(a), graphgear.inference.serve(b)
    x = torch.randn(2, 32)
    for _ in range(3):
        assert_close(fa(x), a(x), reduction=32, what="first model")
    for _ in range(3):
        assert_close(fb(x), b(x), reduction=32, what="second model")


@torch.no_grad()
@pytest.mark.parametrize("rows", [1, 4])
def test_two_models_of_one_class_on_one_frozen_backend_each_use_their_own_weights(rows: int) -> None:
    """Two instances of one model class compiled with ONE backend object share dynamo's
    graph (their parameters are its inputs). With ``frozen_parameter`` the compiled code
    holds the weights and parameter addresses are left out of the key; each model still
    gets captures and compiled code of its own (they are told apart by which parameters
    they pass), and every output is its own model's, in any order of calls."""
    backend = graphgear.get_backend(make_config("reduce-overhead", warmup_iters=0, frozen_parameter=True))
    a, b = _Scaled(0).eval(), _Scaled(1).eval()
    fa, fb = torch.compile(a, backend=backend), torch.compile(b, backend=backend)
    for _ in range(2):
        x = torch.randn(rows, 16)
        assert_close(fa(x), a(x), reduction=2100, what="first model")
        assert_close(fb(x), b(x), reduction=2100, what="second model")
        assert_close(fa(x), a(x), reduction=2100, what="first model, after the second")
    del fb, b
    gc.collect()
    c = _Scaled(2).eval()  # a third model: its parameters may reuse the second's ids
    fc = torch.compile(c, backend=backend)
    x = torch.randn(rows, 16)
    assert_close(fc(x), c(x), reduction=2100, what="third model")
    assert_close(fa(x), a(x), reduction=2100, what="first model, after the third")


def test_frozen_small_m_products_are_packed_for_mkl_and_equal_eager() -> None:
    """pack_frozen_linears: ``mm``/``addmm`` with a frozen fp32 weight and 2..64 rows
    become MKL's packed GEMM (one packed copy per weight and row count) and compute what
    they did; one row, a weight that is an input, or another dtype is left alone."""
    from graphgear._torch.fx import make_fx_allowing_real_inputs
    from graphgear.cpu.passes.pack_frozen import mkl_packing_available, pack_frozen_linears

    if not mkl_packing_available():
        pytest.skip("this torch has no MKL")
    torch.manual_seed(0)
    w1, b1, w2 = torch.randn(48, 32), torch.randn(48), torch.randn(32, 48)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("w1", w1)
            self.register_buffer("b1", b1)
            self.register_buffer("w2", w2)

        def forward(self, x: torch.Tensor, w_in: torch.Tensor) -> torch.Tensor:
            h = torch.nn.functional.linear(x, self.w1, self.b1).relu()
            return torch.nn.functional.linear(h, self.w2) + torch.nn.functional.linear(x, w_in)

    for rows, want in [(1, 0), (3, 2), (8, 2), (65, 0)]:
        x, w_in = torch.randn(rows, 32), torch.randn(32, 32)
        gm = make_fx_allowing_real_inputs(Net())(x, w_in)
        gm.graph.eliminate_dead_code()
        expected = Net()(x, w_in)
        assert pack_frozen_linears(gm) == want, rows
        packed = gm.graph.find_nodes(op="call_function", target=torch.ops.mkl._mkl_linear.default)
        assert len(packed) == want
        assert_close(gm(x, w_in), expected, reduction=48)
    half = make_fx_allowing_real_inputs(Net().double())(torch.randn(4, 32).double(), torch.randn(32, 32).double())
    assert pack_frozen_linears(half) == 0


def test_frozen_products_of_the_same_rows_are_grouped_then_packed_and_equal_eager() -> None:
    """group_frozen_products: a layer's q/k/v-style products (with bias) of one hidden
    state, reached through separate views as traced graphs have them, become one product
    over the concatenated weights and one packed MKL call; the gate/up-style pair (no
    bias) another; a product of other rows, a lone product and one row are left alone.
    Every output equals eager's."""
    from graphgear._torch.fx import make_fx_allowing_real_inputs
    from graphgear.cpu.passes.pack_frozen import (
        group_frozen_products,
        mkl_packing_available,
        pack_frozen_linears,
    )

    if not mkl_packing_available():
        pytest.skip("this torch has no MKL")
    torch.manual_seed(0)

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name, n, bias in [("q", 24, True), ("k", 8, True), ("v", 8, True), ("gate", 40, False),
                                  ("up", 40, False), ("down", 16, False), ("other", 16, False)]:
                self.add_module(name, torch.nn.Linear(16 if name != "down" else 40, n, bias=bias))
                getattr(self, name).requires_grad_(False)

        def forward(self, h: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
            b, s, _ = h.shape
            q, k, v = self.q(h), self.k(h), self.v(h)  # each a view of h, then addmm
            mlp = self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))
            return q.view(b, s, 3, 8) * 2, k + v, mlp, self.other(g)

    net = Layer()
    for batch, want_groups, want_calls in [(4, 2, 4), (1, 0, 0)]:
        h, g = torch.randn(batch, 1, 16), torch.randn(batch, 1, 16)
        gm = make_fx_allowing_real_inputs(net)(h, g)
        gm.graph.eliminate_dead_code()
        assert group_frozen_products(gm) == want_groups, batch
        assert pack_frozen_linears(gm) == want_calls, batch  # q|k|v, gate|up, down, other
        for got, want in zip(gm(h, g), net(h, g)):
            assert got.shape == want.shape
            assert_close(got, want, reduction=40)

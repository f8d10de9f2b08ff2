"""The CPU graph's replay paths, probed as a user would: the kernel-call replay
(straight-line generated code replayed as a fixed list of kernel calls) and outputs
handed out again when nothing but graphgear reaches them. Each result is checked
against eager PyTorch; each way a caller can still reach an output (a reference, a view,
a weak reference, an autograd node, changed metadata) must stop it being handed out
again, and the output then goes stale as before."""

from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

import pytest
import torch
import torch.utils.dlpack

import graphgear
import graphgear.cpu.kernels.decode_attention_kernel as attention_kernel
from graphgear.capture import CaptureEngine, liveness
from graphgear.capture.cpu_graph import CPUGraph
from tests.helpers import assert_close
from tests.helpers import last_record as _rec
from tests.helpers import make_backend as _ro
from tests.models import CacheWriter, Net, hf_qwen2_pair

pytestmark = pytest.mark.inductor


def _graphs() -> list[CPUGraph]:
    """The CPU graphs captured for the last compiled graph (by its engines: one per gear)."""
    rec = _rec()
    engines = [o for o in gc.get_objects() if type(o) is CaptureEngine and o.record is rec]
    return [e.graph for en in engines for e in en.entries.values() if e.graph is not None]


def _count_new_aliases(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the aliases the pool makes from now on (``ids`` of outputs cannot tell: a
    freed tensor's address is reused by the next one)."""
    made = [0]
    orig = liveness.alias

    def alias(static: torch.Tensor) -> torch.Tensor:
        made[0] += 1
        return orig(static)

    monkeypatch.setattr(liveness, "alias", alias)
    return made


# ---- kernel-call replay ----------------------------------------------------------------


@torch.no_grad()
def test_straight_line_code_replays_as_kernel_calls_with_the_cache_written_in_place() -> None:
    """The generated code of this graph is straight-line: its replays are a list of
    kernel calls. Outputs and the cache (written in place) equal eager at every step,
    also after the cache moves (the calls are re-pointed at the new cache)."""
    torch.manual_seed(0)
    net, ref = CacheWriter(), CacheWriter()
    ref.load_state_dict(net.state_dict())
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    cache, ref_cache = torch.zeros(4, 8), torch.zeros(4, 8)
    for p in range(4):
        x = torch.randn(1, 8)
        assert_close(f(x, torch.tensor([p]), cache), ref(x, torch.tensor([p]), ref_cache), reduction=8)
        assert_close(cache, ref_cache, reduction=8)
    (g,) = _graphs()
    assert g.program is not None and g.program.calls, "the straight-line code should replay as kernel calls"
    cache, ref_cache = torch.ones(4, 8), torch.ones(4, 8)  # moved: rebound, calls re-pointed
    for p in range(4):
        x = torch.randn(1, 8)
        assert_close(f(x, torch.tensor([p]), cache), ref(x, torch.tensor([p]), ref_cache), reduction=8)
        assert_close(cache, ref_cache, reduction=8)
    assert g.program is not None
    assert sum(r.rebinds for r in graphgear.stats().graphs) == 1
    assert sum(r.captures for r in graphgear.stats().graphs) == 1


@torch.no_grad()
def test_a_moved_cache_re_points_the_kernel_calls_without_reading_the_code_again() -> None:
    """A moved cache, here a slice of a larger buffer (another storage offset) and then
    a tensor of its own again: the same program object, its calls re-pointed at the new
    memory (the views the code takes of it included); the buffer around the slice is
    never written; results equal eager's at every step."""
    torch.manual_seed(0)
    net, ref = CacheWriter(), CacheWriter()
    ref.load_state_dict(net.state_dict())
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    f(torch.randn(1, 8), torch.tensor([0]), torch.zeros(4, 8))
    (g,) = _graphs()
    prog = g.program
    assert prog is not None and prog.slots, "the cache's uses should be recorded"
    big = torch.full((6, 8), 7.0)
    for cache, ref_cache in ((big[1:5], torch.zeros(4, 8)), (torch.zeros(4, 8), torch.zeros(4, 8))):
        cache.zero_()
        for p in range(4):
            x = torch.randn(1, 8)
            assert_close(f(x, torch.tensor([p]), cache), ref(x, torch.tensor([p]), ref_cache), reduction=8)
            assert_close(cache, ref_cache, reduction=8)
        assert g.program is prog
    assert (big[0] == 7).all() and (big[5] == 7).all()
    assert sum(r.rebinds for r in graphgear.stats().graphs) == 2


@torch.no_grad()
def test_rebinding_an_input_of_other_strides_is_refused_with_a_clear_error() -> None:
    torch.manual_seed(0)
    f = torch.compile(CacheWriter(), backend=_ro(warmup_iters=0))
    f(torch.randn(1, 8), torch.tensor([0]), torch.zeros(4, 8))
    (g,) = _graphs()
    i = next(k for k, a in enumerate(g.args) if isinstance(a, torch.Tensor) and a.shape == (4, 8))
    with pytest.raises(RuntimeError, match=r"strides .*\(1, 4\).*graphgear bug"):
        g.rebind(i, torch.zeros(8, 4).t())


class TwoLinear3d(torch.nn.Module):
    """Two linear layers over a 3-d input: the second product reads a view
    (``reinterpret_tensor``) of the first's buffer, and the output is a view too."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_kernel_call_replay_follows_the_pool_when_its_blocks_grow() -> None:
    """A capture at a larger gear grows the pool's blocks and moves the earlier
    capture's buffers; the earlier capture's kernel calls (views of those buffers made
    when they were built) move with them: its replays still equal eager."""
    torch.manual_seed(0)
    net = TwoLinear3d()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    small, big = torch.randn(2, 3, 8), torch.randn(64, 3, 8)
    graphgear.set_dim_gears(small, {0: [2, 64]})
    graphgear.set_dim_gears(big, {0: [2, 64]})
    with torch.inference_mode():
        assert_close(f(small), net(small), reduction=8)
        assert_close(f(big), net(big), reduction=8)  # grows the blocks
        for _ in range(2):  # new values each time: stale memory would show
            small.normal_()
            big.normal_()
            assert_close(f(small), net(small), reduction=8)
            assert_close(f(big), net(big), reduction=8)
    graphs = _graphs()
    assert len(graphs) == 2 and all(g.program is not None for g in graphs)


# ---- outputs handed out again ------------------------------------------------------------


@torch.no_grad()
def test_a_dropped_output_is_handed_out_again_with_the_new_values(monkeypatch: pytest.MonkeyPatch) -> None:
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    made = _count_new_aliases(monkeypatch)
    for _ in range(5):
        x = torch.randn(2, 8)
        out = f(x)
        assert_close(out, net(x), reduction=8)
        del out
    assert made[0] == 1, "an output nobody holds should be handed out again"


@torch.no_grad()
def test_a_held_output_is_not_handed_out_again_and_goes_stale() -> None:
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    f(x1)
    kept = f(x1)
    out2 = f(x2)
    assert out2 is not kept
    with pytest.raises(RuntimeError, match="overwritten"):
        kept + 0
    assert_close(out2, net(x2), reduction=8)


_REACHES = {
    "view": lambda t: t[0],
    "slice": lambda t: t[:, 1:],
    "storage": lambda t: t.untyped_storage(),
    "numpy": lambda t: t.numpy(),
    "detach": lambda t: t.detach(),
    "dlpack": lambda t: torch.utils.dlpack.to_dlpack(t),
    "container": lambda t: [t],
}


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("reach", list(_REACHES.values()), ids=list(_REACHES))
def test_an_output_still_reached_otherwise_is_never_handed_out_again(reach: Any, grad_mode: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Under inference_mode a view keeps no ``_base`` (the output's reference count does
    not change): only the storage's user count shows it."""
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    with grad_mode():
        f(x1)
        out = f(x1)
        want1 = out.clone()
        held = reach(out)
        del out
        made = _count_new_aliases(monkeypatch)
        out2 = f(x2)
        assert made[0] == 1, "a reached output must not be handed out again"
        assert_close(out2, net(x2), reduction=8)
        if isinstance(held, torch.Tensor):  # a view: stale, never the new values
            with pytest.raises(RuntimeError, match="overwritten"):
                held + 0
        elif isinstance(held, torch.UntypedStorage):  # its storage: poisoned too
            with pytest.raises(RuntimeError, match="overwritten"):
                held[0]
        elif isinstance(held, list):  # the tensor itself, held elsewhere
            assert held[0] is not out2
            with pytest.raises(RuntimeError, match="overwritten"):
                held[0] + 0
        del held
        assert_close(want1, net(x1), reduction=8)


@torch.no_grad()
def test_a_weakly_referenced_output_is_not_handed_out_again() -> None:
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    f(x1)
    out = f(x1)
    ref = weakref.ref(out)
    del out
    out2 = f(x2)
    assert ref() is None or ref() is not out2, "a weak reference must not see the next output"
    assert_close(out2, net(x2), reduction=8)


_CHANGES = {
    "unsqueeze_": lambda t: t.unsqueeze_(0),
    "t_": lambda t: t.t_(),
    "requires_grad_": lambda t: t.requires_grad_(),
    "attribute": lambda t: setattr(t, "note", 1),
    "grad": lambda t: setattr(t, "grad", torch.zeros_like(t)),
}


@pytest.mark.parametrize("change", list(_CHANGES.values()), ids=list(_CHANGES))
def test_an_output_changed_in_place_then_dropped_comes_back_as_a_fresh_output(change: Any) -> None:
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    with torch.no_grad():
        f(x1)
        out = f(x1)
        shape = out.shape
        change(out)
        del out
        out2 = f(x2)
    assert out2.shape == shape and not out2.requires_grad and out2.grad is None
    assert not hasattr(out2, "note")
    assert_close(out2, net(x2), reduction=8)


def test_an_output_an_autograd_node_saved_is_not_handed_out_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The output, used by a product that autograd saves for backward, then dropped:
    only the autograd node reaches it. It must not be handed out (and overwritten)
    again; backward then raises the stale-output error instead of using new values."""
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    w = torch.ones(2, 8, requires_grad=True)
    with torch.no_grad():
        f(x1)
        out = f(x1)
    loss = (w * out).sum()  # saves out for w's gradient
    del out
    made = _count_new_aliases(monkeypatch)
    with torch.no_grad():
        out2 = f(x2)
    assert made[0] == 1
    assert_close(out2, net(x2), reduction=8)
    with pytest.raises(RuntimeError, match="overwritten"):
        loss.backward()


@torch.no_grad()
def test_hand_out_again_keeps_reference_counts_as_they_were() -> None:
    """After many steps whose outputs are dropped, nothing leaks: the output's
    reference count is the caller's own, and the pool keeps no poisoned hand-outs."""
    f = torch.compile(Net(), backend=_ro(warmup_iters=0))
    x = torch.randn(2, 8)
    for _ in range(50):
        f(x)
    out = f(x)
    assert sys.getrefcount(out) == 3  # out, the argument, the engine's hand-out
    rec = _rec()
    (engine,) = [o for o in gc.get_objects() if type(o) is CaptureEngine and o.record is rec]
    arena = engine.pool.arena()
    assert len(arena.handed) == 1 and not arena.kept


@pytest.mark.slow
@torch.no_grad()
def test_served_transformers_decoder_replays_kernel_calls_and_recycles_its_logits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A served transformers Qwen2 at batch 1: the decode step's generated code is
    straight-line (fused kernels around each layer's call of graphgear's attention
    kernel) and replays as kernel calls; logits a caller drops
    come back as the next step's logits. Logits and the KV cache equal eager at every
    step, and a step's logits that the caller keeps go stale, never silently change."""
    from transformers import StaticCache

    cfg, model, ref = hf_qwen2_pair()
    f = graphgear.inference.serve(model)
    cache, ref_cache = StaticCache(config=cfg, max_cache_len=16), StaticCache(config=cfg, max_cache_len=16)
    tok = ref_tok = torch.tensor([[5]])
    made = _count_new_aliases(monkeypatch)
    per_step = []
    kept = None
    for p in range(8):
        pos = torch.full((1, 1), p)
        out = f(input_ids=tok, cache=cache, position_ids=pos, use_cache=True).logits
        want = ref(input_ids=ref_tok, cache=ref_cache, position_ids=pos, use_cache=True).logits
        assert_close(out, want, reduction=128)
        assert_close(cache.layers[1].values, ref_cache.layers[1].values, reduction=64)
        tok, ref_tok = out[:, -1:].argmax(-1), want[:, -1:].argmax(-1)
        per_step.append(made[0])
        if p == 5:
            kept = out
        del out
    graphs = [g for g in _graphs_of_all() if g.program is not None]
    assert graphs, "the step should replay as kernel calls"
    for g in graphs:
        fns = [c[0] for c in g.program.calls]
        assert fns.count(attention_kernel.kernel()) == cfg.num_hidden_layers, fns
        assert len(fns) == 2 * cfg.num_hidden_layers + 1, "a fused kernel before each attention and one after the last"
    new = [b - a for a, b in zip(per_step, per_step[1:])]  # aliases made at steps 1..7
    assert new[3:5] == [0, 0], f"dropped logits should come back as the next step's: {new}"
    assert new[5] == 1 and new[6] == 0, f"kept logits are not handed out again: {new}"
    assert kept is not None
    with pytest.raises(RuntimeError, match="overwritten"):
        kept + 0


def _graphs_of_all() -> list[CPUGraph]:
    """The CPU graphs of every graph compiled in this test."""
    recs = [id(r) for r in graphgear.stats().graphs]
    return [e.graph for o in gc.get_objects() if type(o) is CaptureEngine and id(o.record) in recs
            for e in o.entries.values() if e.graph is not None]


@torch.no_grad()
def test_a_kernel_error_mid_replay_reaches_the_caller_and_the_next_call_is_right() -> None:
    """An index out of range inside the kernel calls (Inductor's bounds check in the
    generated C++) raises to the caller as the graph's own error; the graph stays
    captured and the next valid call equals eager, cache included."""
    torch.manual_seed(0)
    net, ref = CacheWriter(), CacheWriter()
    ref.load_state_dict(net.state_dict())
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    cache, ref_cache = torch.zeros(4, 8), torch.zeros(4, 8)
    x = torch.randn(1, 8)
    f(x, torch.tensor([0]), cache)
    ref(x, torch.tensor([0]), ref_cache)
    (g,) = _graphs()
    assert g.program is not None
    with pytest.raises(RuntimeError, match="out of bounds|index"):
        f(x, torch.tensor([9]), cache)
    assert_close(cache, ref_cache, reduction=8)
    for p in (1, 2):
        x = torch.randn(1, 8)
        assert_close(f(x, torch.tensor([p]), cache), ref(x, torch.tensor([p]), ref_cache), reduction=8)
        assert_close(cache, ref_cache, reduction=8)
    assert sum(r.captures for r in graphgear.stats().graphs) == 1


class CacheReturner(torch.nn.Module):
    """Writes its input into a cache passed in and returns the cache itself and a sum."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache.index_copy_(0, pos, self.lin(x))
        return cache, cache.sum(0)


@torch.no_grad()
def test_an_output_that_is_the_callers_cache_follows_the_cache_when_it_moves() -> None:
    torch.manual_seed(0)
    net, ref = CacheReturner(), CacheReturner()
    ref.load_state_dict(net.state_dict())
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    for _ in range(2):  # the second round's cache is a new one: rebound
        cache, ref_cache = torch.zeros(4, 8), torch.zeros(4, 8)
        for p in range(3):
            x = torch.randn(1, 8)
            got, s = f(x, torch.tensor([p]), cache)
            want, ws = ref(x, torch.tensor([p]), ref_cache)
            assert got.data_ptr() == cache.data_ptr(), "the cache itself, never a copy"
            assert_close(got, want, reduction=8)
            assert_close(s, ws, reduction=8)
    assert sum(r.captures for r in graphgear.stats().graphs) == 1

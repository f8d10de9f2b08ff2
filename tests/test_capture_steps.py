"""reduce-overhead and steps: a graph called again in one top-level call (a weight-tied
block, a module reused in a loop) while its outputs of that call are still in use gives
eager's results; outputs kept across top-level calls still go stale and raise."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch

import graphgear
from tests.helpers import assert_close, make_config
from tests.helpers import make_backend as _ro
from tests.models import Net
from tests.models.tied_blocks import ItemBlock, ReusedInLoop, TiedTwice

pytestmark = pytest.mark.inductor


def _captures() -> list[int]:
    return [g.captures for g in graphgear.stats().graphs]


@torch.no_grad()
def test_a_block_called_twice_in_one_forward_gives_eager_results() -> None:
    model = TiedTwice().eval()
    f = torch.compile(model, backend=_ro())
    for _ in range(4):  # warm-up, capture, then replays of both instances
        x = torch.randn(2, 8)
        assert_close(f(x), model(x), reduction=8)
    # the block's second graph is called twice with its first output alive: two captures
    assert max(_captures()) == 2, graphgear.stats()


@torch.no_grad()
@pytest.mark.parametrize("n", [2, 3])
def test_a_block_reused_in_a_loop_keeps_every_output(n: int) -> None:
    model = ReusedInLoop(n).eval()
    f = torch.compile(model, backend=_ro(warmup_iters=0))
    for _ in range(3):
        x = torch.randn(2, 8)
        assert_close(f(x), model(x), reduction=8 * n)
    assert max(_captures()) == n


@torch.no_grad()
def test_a_block_with_a_host_read_called_twice() -> None:
    model = TiedTwice(ItemBlock()).eval()
    f = torch.compile(model, backend=_ro(warmup_iters=0))
    for _ in range(3):
        x = torch.randn(2, 8)
        assert_close(f(x), model(x), reduction=8)


@torch.no_grad()
def test_outputs_kept_across_calls_of_a_tied_model_still_go_stale() -> None:
    model = TiedTwice().eval()
    f = torch.compile(model, backend=_ro(warmup_iters=0))
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    f(x1)
    out1 = f(x1)
    out2 = f(x2)  # a second top-level call: out1 is overwritten
    with pytest.raises(RuntimeError, match="overwritten.*clone_output=True"):
        out1 + 0
    assert_close(out2, model(x2), reduction=8)
    out3 = f(x1)
    with pytest.raises(RuntimeError, match="overwritten"):
        out2 + 0
    assert_close(out3, model(x1), reduction=8)
    assert max(_captures()) == 2  # the second instance is reused, not captured again


@torch.no_grad()
def test_without_dynamo_each_call_is_a_step_of_its_own() -> None:
    """The FX compiler called directly: no top-level compiled call, so a second call
    overwrites the first one's outputs (and they raise) as before."""
    net = Net().eval()
    x = torch.randn(2, 8)
    gm = torch.fx.symbolic_trace(net)
    fn = graphgear.get_compiler(make_config("reduce-overhead", warmup_iters=0))(gm, [x])
    fn(x)
    out1 = fn(x)
    out2 = fn(torch.ones(2, 8))
    o1 = out1[0] if isinstance(out1, (list, tuple)) else out1
    with pytest.raises(RuntimeError, match="overwritten"):
        o1 + 0
    o2 = out2[0] if isinstance(out2, (list, tuple)) else out2
    assert_close(o2, net(torch.ones(2, 8)), reduction=8)


def test_threads_calling_a_tied_model_get_their_own_results() -> None:
    model = TiedTwice().eval()
    f = torch.compile(model, backend=_ro(warmup_iters=0))
    inputs = [[torch.randn(2, 8) for _ in range(6)] for _ in range(2)]
    with torch.no_grad():
        want = [[model(x) for x in xs] for xs in inputs]
        f(inputs[0][0])  # compile in one thread first
    got: list[list[Any]] = [[], []]
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def worker(k: int) -> None:
        try:
            barrier.wait()
            with torch.no_grad():
                for x in inputs[k]:
                    got[k].append(f(x).clone())
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for k in range(2):
        assert_close(got[k], want[k], reduction=8, what=f"thread {k}")


def test_a_tied_block_in_training_gives_eager_gradients() -> None:
    model = ReusedInLoop(3)
    ref = copy.deepcopy(model)
    f = torch.compile(model, backend=_ro())
    for _ in range(3):
        x = torch.randn(2, 8)
        loss, want = f(x).square().mean(), ref(x).square().mean()
        assert_close(loss, want, reduction=24)
        loss.backward()
        want.backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, reduction=24, what=name)
            p.grad = q.grad = None

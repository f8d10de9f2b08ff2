"""A server's session threads: a thread that ends leaves its captures to the next new
thread (transformers' ``generate_batch`` runs every call on a new thread), instead of
every session capturing every graph again; what the ended thread handed out still
raises when read after the new thread's replay."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import graphgear
from tests.models.tied_blocks import BreakBlock


def _ro(model: nn.Module) -> Callable[..., Any]:
    return torch.compile(model, backend="graphgear", options={"mode": "reduce-overhead"})


def _in_thread(fn: Callable[[], Any]) -> Any:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["out"]


def _counts() -> tuple[int, int, int]:
    graphs = graphgear.stats().graphs
    return (sum(g.compiles for g in graphs), sum(g.captures for g in graphs), sum(g.replays for g in graphs))


@pytest.mark.parametrize("block", [nn.Sequential(nn.Linear(8, 8), nn.Tanh()), BreakBlock()],
                         ids=["one-graph", "graph-break"])
def test_a_new_thread_takes_over_the_captures_of_the_thread_that_ended(block: nn.Module) -> None:
    model = block.eval()
    f = _ro(model)
    xs = [torch.randn(2, 8) for _ in range(6)]

    def session(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            return [f(x).clone() for x in inputs]

    with torch.no_grad():
        ref = [model(x) for x in xs]
    first = _in_thread(lambda: session(xs[:3]))  # warm-up, capture, replay
    after_first = _counts()
    assert after_first[1] > 0
    for _ in range(3):  # three more sessions, each on a new thread
        out = _in_thread(lambda: session(xs[3:]))
        for o, r in zip(out, ref[3:]):
            torch.testing.assert_close(o, r)
    compiles, captures, replays = _counts()
    assert (compiles, captures) == after_first[:2], (after_first, _counts())
    assert replays >= after_first[2] + 9
    for o, r in zip(first, ref[:3]):
        torch.testing.assert_close(o, r)


def test_an_output_the_ended_thread_handed_out_is_stale_after_the_new_threads_replay() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).eval()
    f = _ro(model)
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)

    def session(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for _ in range(2):
                f(x)
            return f(x)  # a replay's output, not cloned

    kept = _in_thread(lambda: session(x1))
    with torch.no_grad():
        torch.testing.assert_close(kept, model(x1))  # still valid: nothing replayed since
    captures = _counts()[1]
    out = _in_thread(lambda: session(x2).clone())
    with torch.no_grad():
        torch.testing.assert_close(out, model(x2))
    assert _counts()[1] == captures  # taken over, not captured again
    with pytest.raises(RuntimeError, match="overwritten|released"):
        kept + 1


def test_threads_alive_at_once_keep_their_own_captures_and_results() -> None:
    """Taking over is only from threads that ended: two live threads never share."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).eval()
    f = _ro(model)
    xs = {0: torch.randn(2, 8), 1: torch.randn(2, 8)}
    barrier = threading.Barrier(2)
    results: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with torch.no_grad():
                outs = []
                for _ in range(4):
                    barrier.wait(timeout=60)
                    outs.append(f(xs[i]).clone())
                results[i] = outs
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    with torch.no_grad():
        for i in range(2):
            for o in results[i]:
                torch.testing.assert_close(o, model(xs[i]))


def test_reset_between_sessions_then_a_new_thread_compiles_and_serves_again() -> None:
    """graphgear.reset() after a session thread ended releases what it left; the next
    thread compiles and captures afresh and gets eager's results; an output the first
    thread handed out raises when read."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).eval()
    f = _ro(model)
    x = torch.randn(2, 8)

    def session() -> torch.Tensor:
        with torch.no_grad():
            for _ in range(2):
                f(x)
            return f(x)

    kept = _in_thread(session)
    graphgear.reset()
    with pytest.raises(RuntimeError, match="released|overwritten"):
        kept + 1
    out = _in_thread(lambda: session().clone())
    with torch.no_grad():
        torch.testing.assert_close(out, model(x))
    assert _counts()[1] >= 1

"""The warm-up stance (``graphgear.mark_warm``): after it, a new graph or graph key
warns, raises, or runs uncompiled, and is counted in ``stats().warm``; outputs stay
eager's in every case."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import graphgear
from graphgear.errors import ConfigError
from tests.helpers import assert_close, last_record, make_backend

pytestmark = pytest.mark.inductor


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _geared(n: int) -> torch.Tensor:
    x = torch.randn(n, 16)
    graphgear.set_dim_gears(x, {0: [2, 4, 8]})
    return x


@pytest.fixture
def served():
    model = MLP().eval()
    compiled = torch.compile(model, backend=make_backend("reduce-overhead"))
    with torch.no_grad():
        for _ in range(3):
            compiled(_geared(2))  # warm-up: gear 2 compiled and captured
    yield model, compiled
    graphgear.mark_warm(None)


@torch.no_grad()
def test_raise_names_the_graph_and_sizes(served) -> None:
    model, compiled = served
    compiles = last_record().compiles
    graphgear.mark_warm("raise")
    x = _geared(2)
    assert_close(compiled(x), model(x), reduction=32)  # a warm key serves as before
    with pytest.raises(graphgear.GraphgearError, match=r"x\.size\(\)\[0\]=4.*mark_warm") as info:
        compiled(_geared(4))
    assert "precompile_gears" in str(info.value)
    warm = graphgear.stats().warm
    assert (warm.on_new, warm.new_keys, warm.new_graphs) == ("raise", 1, 0)
    assert last_record().compiles == compiles  # nothing compiled


@torch.no_grad()
def test_eager_runs_new_sizes_uncompiled_and_counts_once(served, caplog: pytest.LogCaptureFixture) -> None:
    model, compiled = served
    compiles = last_record().compiles
    graphgear.mark_warm("eager")
    with caplog.at_level(logging.WARNING, logger="graphgear"):
        for _ in range(3):
            x = _geared(4)
            assert_close(compiled(x), model(x), reduction=32)
    assert sum("mark_warm" in r.getMessage() for r in caplog.records) == 1
    assert graphgear.stats().warm.new_keys == 1
    rec = last_record()
    assert rec.compiles == compiles and rec.uncaptured_runs >= 3


@torch.no_grad()
def test_warn_compiles_and_says_so(served, caplog: pytest.LogCaptureFixture) -> None:
    model, compiled = served
    compiles = last_record().compiles
    graphgear.mark_warm("warn")
    with caplog.at_level(logging.WARNING, logger="graphgear"):
        for _ in range(3):
            x = _geared(8)
            assert_close(compiled(x), model(x), reduction=32)
    assert any("It compiles now" in r.getMessage() for r in caplog.records)
    assert last_record().compiles == compiles + 1
    assert graphgear.stats().warm.events[0].startswith(last_record().name)


@torch.no_grad()
def test_a_new_dynamo_graph_after_warm(caplog: pytest.LogCaptureFixture) -> None:
    model = MLP().eval()
    compiled = torch.compile(model, backend=make_backend("max-autotune"), dynamic=False)
    compiled(torch.randn(2, 16))
    graphgear.mark_warm("raise")
    with pytest.raises(Exception, match="mark_warm") as info:
        compiled(torch.randn(3, 16))  # a new static shape: dynamo hands over a new graph
    assert "a new graph" in str(info.value)
    graphgear.mark_warm("eager")
    x = torch.randn(5, 16)
    assert_close(compiled(x), model(x), reduction=32)
    warm = graphgear.stats().warm
    assert warm.new_graphs == 1 and len(graphgear.stats().graphs) == 1  # the 5-row graph ran as it is
    graphgear.mark_warm(None)


@torch.no_grad()
def test_the_stance_holds_in_other_threads(served) -> None:
    _, compiled = served
    graphgear.mark_warm("raise")
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            with torch.no_grad():  # grad mode is per thread: the same graph as the main thread's
                compiled(_geared(4))
        except graphgear.GraphgearError as e:
            errors.append(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join(300)
    assert len(errors) == 1


def test_bad_stance_and_reset() -> None:
    with pytest.raises(ConfigError, match=r"on_new='sometimes'.*'warn', 'raise', 'eager'"):
        graphgear.mark_warm("sometimes")
    graphgear.mark_warm("raise")
    assert graphgear.stats().warm.on_new == "raise"
    graphgear.reset()
    assert graphgear.stats().warm.on_new is None

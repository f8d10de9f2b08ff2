"""What a block called twice in one forward costs in reduce-overhead (issue 43).

A two-block model whose block holds a graph break (``torch._dynamo.graph_break()``),
width ``--width``, batch 1, inference; per call, median of ``--iters`` calls after
warm-up, contenders interleaved in rounds, printed as ratios in one run:

- ``tied``: one block called twice (``a = block(x); b = block(a); return a + b``): the
  block's second graph replays again while ``a`` is alive, so it runs in a second
  capture of the same code (a lane: memory of its own);
- ``untied``: two blocks of the same shape (no graph called twice: one capture each);
- ``tied, clone_output``: every output copied (what copying the live outputs out before
  the second replay would cost at most);
- eager.

Also printed: the graphs' pool bytes (tied vs untied: the lane's memory) and the cost
of finding the step (a walk of the Python stack, once per step and pool).
Usage: ``python benchmarks/bench_tied_blocks.py [--iters 1000] [--width 256]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from graphgear.cache.store import use_private_inductor_cache  # noqa: E402

use_private_inductor_cache()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import graphgear  # noqa: E402

try:
    from graphgear.capture.steps import StepClock
except ImportError:  # graphgear before issue 43
    StepClock = None  # type: ignore[assignment,misc]


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        torch._dynamo.graph_break()
        return y * 2 + 1


class OtherBlock(nn.Module):
    """Block's twin with code of its own (dynamo compiles it apart: no graph shared with
    the tied model's)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        torch._dynamo.graph_break()
        return y * 2 + 1


class Two(nn.Module):
    def __init__(self, width: int, tied: bool) -> None:
        super().__init__()
        self.first: nn.Module = Block(width)
        self.second: nn.Module = self.first if tied else OtherBlock(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.first(x)
        b = self.second(a)
        return a + b


def _time(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(1, a.width)
    tied, untied = Two(a.width, True).eval(), Two(a.width, False).eval()
    contenders: dict[str, Callable[[], Any]] = {"eager": lambda: tied(x)}
    pools: dict[str, int] = {}
    for name, model, opts in [("tied", tied, {}), ("untied", untied, {}),
                              ("tied, clone_output", tied, {"clone_output": True})]:
        n0 = len(graphgear.stats().graphs)
        f = torch.compile(model, backend="graphgear", options={"mode": "reduce-overhead", **opts})
        with torch.no_grad():
            for _ in range(4):
                torch.testing.assert_close(f(x), model(x))
        pools[name] = sum(g.pool_bytes for g in graphgear.stats().graphs[n0:])
        contenders[name] = lambda f=f: f(x)
    times: dict[str, list[float]] = {k: [] for k in contenders}
    with torch.no_grad():
        for _ in range(a.rounds):
            for k, fn in contenders.items():
                times[k] += _time(fn, a.iters // a.rounds)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    print(f"width {a.width}, batch 1, {a.iters} calls each, median us per call (ratio to eager; to untied)")
    for k, us in med.items():
        print(f"  {k:20s} {us:8.1f} us  {us / med['eager']:5.2f}x  {us / med['untied']:5.2f}x")
    print(f"pool bytes: tied {pools['tied']}, untied {pools['untied']}, "
          f"tied with clone_output {pools['tied, clone_output']}")
    if StepClock is None:
        return
    clock = StepClock()
    walk = statistics.median(_time(lambda: (setattr(clock, "gen", -2), clock.current()), 2000)) * 1e6
    print(f"finding the step (stack walk, {len(_stack())} frames deep here): {walk:.2f} us, once per step and pool")


def _stack() -> list[Any]:
    f, out = sys._getframe(), []
    while f is not None:
        out.append(f)
        f = f.f_back
    return out


if __name__ == "__main__":
    main()

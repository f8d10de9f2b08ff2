"""A step with one host read in the middle: piecewise capture vs the whole-graph fallback.

    python benchmarks/bench_piecewise.py [--width 256] [--layers 4] [--batch 4]
                                         [--steps 200] [--rounds 5] [--threads 1]

The model runs ``layers`` linear + GELU blocks, reads one value back to the host
(``.item()``: the number of positive activations) and scales the rest of the step by it,
then ``layers`` more blocks. Contenders, side by side in one run (interleaved rounds,
rotating order; each cell the median over rounds):

- ``eager``;
- ``graphgear-reduce-overhead, fallback``: ``split_uncapturable=False``, the graph runs
  uncaptured (compiled) because of the host read, as every graph with one did before
  piecewise capture;
- ``graphgear-reduce-overhead, piecewise``: the default; the host read is a split point,
  both sides are captured.

Each contender's output is checked against eager's before timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from graphgear.cache.store import use_private_inductor_cache

use_private_inductor_cache()

import torch  # noqa: E402
from torch import nn  # noqa: E402

import graphgear  # noqa: E402

CONTENDERS = ("eager", "graphgear-reduce-overhead, fallback", "graphgear-reduce-overhead, piecewise")


class HostReadNet(nn.Module):
    """``layers`` blocks, a host read, ``layers`` more blocks."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.first = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.second = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.first:
            x = torch.nn.functional.gelu(lin(x))
        k = (x > 0).sum().item()  # a host read: the rest of the step depends on it
        x = x / (k + 1)
        for lin in self.second:
            x = torch.nn.functional.gelu(lin(x))
        return x


def compiled(name: str, model: nn.Module) -> Callable[..., Any]:
    if name == "eager":
        return model
    opts: dict[str, Any] = {"mode": "reduce-overhead"}
    if name.endswith("fallback"):
        opts["split_uncapturable"] = False
    return torch.compile(model, backend="graphgear", options=opts, fullgraph=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch._dynamo.config.capture_scalar_outputs = True  # dynamo keeps .item() in the graph
    torch.manual_seed(0)
    model = HostReadNet(args.width, args.layers).eval()
    x = torch.randn(args.batch, args.width)
    samples: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    with torch.no_grad():
        want = model(x)
        fns = {c: compiled(c, model) for c in CONTENDERS}
        for c, fn in fns.items():  # compile, warm up, capture; then check
            for _ in range(3):
                out = fn(x)
            err = float((out - want).abs().max())
            if err > 1e-4:
                raise SystemExit(f"{c}: max abs diff {err:.2e} vs eager")
            print(f"  {c}: max abs diff vs eager {err:.1e}", file=sys.stderr)
        for r in range(args.rounds):
            order = CONTENDERS[r % len(CONTENDERS):] + CONTENDERS[: r % len(CONTENDERS)]
            for c in order:
                fn = fns[c]
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    fn(x)
                samples[c].append((time.perf_counter() - t0) / args.steps)
    med = {c: statistics.median(v) for c, v in samples.items()}
    print(f"\nhost read in the middle: width {args.width}, {args.layers}+{args.layers} layers, batch "
          f"{args.batch}, {args.threads} thread(s), torch {torch.__version__}")
    print(f"{'contender':40s}{'us per step':>14s}{'vs fallback (lower is better)':>32s}")
    for c in CONTENDERS:
        print(f"{c:40s}{med[c] * 1e6:14.0f}{med[c] / med[CONTENDERS[1]]:31.2f}x")
    print(graphgear.stats())


if __name__ == "__main__":
    main()

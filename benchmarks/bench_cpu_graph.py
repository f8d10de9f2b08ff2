"""CPU graph speed: the embedded decoder's batch-1 decode step, side by side in one run.

    python benchmarks/bench_cpu_graph.py [--steps 300] [--rounds 5] [--threads 1]

Runs eager, ``torch.compile`` default (Inductor) and graphgear ``mode="reduce-overhead"``
(graphgear's CPU graph) on the same model and inputs, interleaved in rounds so machine
noise hits all three alike; prints the median step time of each and the ratios the
design asks for (reduce-overhead <= 0.5x eager, <= 1.0x torch.compile default). Exits 1
when a target is missed, so CI can run it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

from graphgear.cache.store import use_private_inductor_cache  # noqa: E402

use_private_inductor_cache()

import torch  # noqa: E402

import graphgear  # noqa: E402
from graphgear.bench.toy_decoder import ToyDecoder  # noqa: E402


def step_time(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], steps: int, max_pos: int) -> float:
    """Median seconds of one decode step over ``steps`` steps (positions cycle)."""
    times = []
    tok = torch.tensor([[1]])
    with torch.no_grad():
        for i in range(steps):
            pos = torch.tensor([i % max_pos])
            t0 = time.perf_counter()
            out = fn(tok, pos)
            times.append(time.perf_counter() - t0)
            tok = out[:, -1:].argmax(-1)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    base = ToyDecoder().eval()
    models = {name: ToyDecoder().eval() for name in ("eager", "inductor", "graphgear")}
    for m in models.values():
        m.load_state_dict(base.state_dict())
    config = graphgear.CompilerConfig()
    config.mode = "reduce-overhead"
    fns: dict[str, Callable[..., torch.Tensor]] = {
        "eager": models["eager"],
        "inductor": torch.compile(models["inductor"]),
        "graphgear": torch.compile(models["graphgear"], backend=graphgear.get_backend(config)),
    }
    max_pos = base.cfg.max_seq_len
    tok, pos = torch.tensor([[1]]), torch.tensor([0])
    with torch.no_grad():  # compile, warm up, capture; and check the outputs agree
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(3):
                fn(tok, pos)
            print(f"{name:10s} first calls: {time.perf_counter() - t0:6.2f} s", file=sys.stderr)
        ref = models["eager"](tok, pos)
        for name in ("inductor", "graphgear"):
            got = fns[name](tok, pos).clone()
            if not torch.allclose(got, ref, atol=1e-4, rtol=1e-4):
                print(f"MISMATCH: {name} differs from eager by {(got - ref).abs().max():.2e}")
                return 1
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(a.rounds):
        for name, fn in fns.items():
            samples[name].append(step_time(fn, a.steps, max_pos))
    med = {k: statistics.median(v) for k, v in samples.items()}
    rec = graphgear.stats().graphs[-1]
    print(f"decoder step, batch 1, {a.threads} thread(s), median of {a.rounds} rounds x {a.steps} steps")
    print(f"{'':24s}{'us/step':>10s}{'vs eager':>10s}{'vs inductor':>13s}")
    for name, label in (("eager", "eager"), ("inductor", "torch.compile default"),
                        ("graphgear", "graphgear reduce-overhead")):
        print(f"{label:24s}{med[name] * 1e6:10.1f}{med[name] / med['eager']:10.2f}"
              f"{med[name] / med['inductor']:13.2f}")
    print(f"graphgear: captures={rec.captures} replays={rec.replays} "
          f"uncaptured_runs={rec.uncaptured_runs} pool_bytes={rec.pool_bytes}")
    ok_eager = med["graphgear"] <= 0.5 * med["eager"]
    ok_ind = med["graphgear"] <= 1.0 * med["inductor"]
    print(f"target reduce-overhead <= 0.5x eager: {'PASS' if ok_eager else 'FAIL'}; "
          f"<= 1.0x torch.compile default: {'PASS' if ok_ind else 'FAIL'}")
    return 0 if ok_eager and ok_ind else 1


if __name__ == "__main__":
    sys.exit(main())

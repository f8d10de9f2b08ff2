"""CPU graph speed: the embedded decoder's batch-1 decode step, side by side in one run.

    python benchmarks/bench_cpu_graph.py [--steps 300] [--rounds 5] [--threads 1]

Runs ``eager``, ``torch.compile`` (its default, Inductor) and
``graphgear-reduce-overhead`` (graphgear's CPU graph) on the same model and inputs,
interleaved in rounds so machine noise hits all three alike; prints the median step time
of each and its speedups (a reference's time / the contender's: higher is better) against
the design's targets (graphgear-reduce-overhead: >= 2.0x vs eager, >= 1.0x vs
torch.compile). Exits 1 when a target is missed, so CI can run it.
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
from graphgear.bench.names import CONTENDERS, speedup_label, speedup_note  # noqa: E402
from graphgear.bench.toy_decoder import ToyDecoder  # noqa: E402

EAGER, TORCH_COMPILE, REDUCE_OVERHEAD = CONTENDERS[0], CONTENDERS[1], CONTENDERS[3]


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
    models = {name: ToyDecoder().eval() for name in (EAGER, TORCH_COMPILE, REDUCE_OVERHEAD)}
    for m in models.values():
        m.load_state_dict(base.state_dict())
    config = graphgear.CompilerConfig()
    config.mode = "reduce-overhead"
    fns: dict[str, Callable[..., torch.Tensor]] = {
        EAGER: models[EAGER],
        TORCH_COMPILE: torch.compile(models[TORCH_COMPILE]),
        REDUCE_OVERHEAD: torch.compile(models[REDUCE_OVERHEAD], backend=graphgear.get_backend(config)),
    }
    max_pos = base.cfg.max_seq_len
    tok, pos = torch.tensor([[1]]), torch.tensor([0])
    with torch.no_grad():  # compile, warm up, capture; and check the outputs agree
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(3):
                fn(tok, pos)
            print(f"{name:26s} first calls: {time.perf_counter() - t0:6.2f} s", file=sys.stderr)
        ref = models[EAGER](tok, pos)
        for name in (TORCH_COMPILE, REDUCE_OVERHEAD):
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
    se, stc = speedup_label(EAGER, direction=False), speedup_label(TORCH_COMPILE, direction=False)
    print(f"{'contender':28s}{'us/step':>10s}{se:>18s}{stc:>26s}")
    for name in (EAGER, TORCH_COMPILE, REDUCE_OVERHEAD):
        print(f"{name:28s}{med[name] * 1e6:10.1f}{med[EAGER] / med[name]:17.2f}x"
              f"{med[TORCH_COMPILE] / med[name]:25.2f}x")
    print(speedup_note(EAGER, TORCH_COMPILE))
    print(f"graphgear: captures={rec.captures} replays={rec.replays} "
          f"uncaptured_runs={rec.uncaptured_runs} pool_bytes={rec.pool_bytes}")
    ok_eager = med[EAGER] >= 2.0 * med[REDUCE_OVERHEAD]
    ok_ind = med[TORCH_COMPILE] >= 1.0 * med[REDUCE_OVERHEAD]
    print(f"target {REDUCE_OVERHEAD} {speedup_label(EAGER)} >= 2.0x: {'PASS' if ok_eager else 'FAIL'}; "
          f"{speedup_label(TORCH_COMPILE)} >= 1.0x: {'PASS' if ok_ind else 'FAIL'}")
    return 0 if ok_eager and ok_ind else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""GPU check for reduce-overhead: one command, under 5 minutes on one GPU.

    python scripts/gpu_check.py [--steps 200]

1. runs the CUDA tests (``tests/test_capture_cuda.py``);
2. times the embedded decoder's batch-1 decode step in eager,
   ``torch.compile(mode="reduce-overhead")`` (Inductor + CUDA graph trees) and graphgear
   ``mode="reduce-overhead"`` (CUDA graphs), checks the tokens agree, and prints a table
   with the design's targets (graphgear <= 1.0x torch.compile reduce-overhead, >= 5x
   faster than eager); ``graphgear-piecewise`` (every CUDA SDPA kernel in
   ``capture_config.split_ops``: attention runs between captured pieces) is reported
   beside them, with no target.

Without CUDA it says so and exits 0 (nothing to check). Exit status 1 when a test fails,
outputs differ, or a target is missed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from graphgear.cache.store import use_private_inductor_cache  # noqa: E402

use_private_inductor_cache()

import torch  # noqa: E402

#: the SDPA kernels of CUDA, as piecewise capture's split ops
SDPA_CUDA = ["aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
             "aten._scaled_dot_product_cudnn_attention"]


def run_tests() -> bool:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           os.path.join(ROOT, "tests", "test_capture_cuda.py")]
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, timeout=240).returncode == 0


def decode(fn: Callable[..., torch.Tensor], steps: int, max_pos: int,
           batch: int = 1) -> tuple[float, list[int]]:
    """Seconds per decode step (wall time of ``steps`` steps, synchronised) and tokens."""
    tok = torch.arange(1, batch + 1, device="cuda").view(batch, 1)
    toks: list[torch.Tensor] = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        out = fn(tok, torch.tensor([i % max_pos], device="cuda"))
        tok = out[:, -1:].argmax(-1)
        toks.append(tok)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    return dt, [int(t) for t in torch.cat(toks).flatten().tolist()]


def bench(steps: int, batch: int) -> bool:
    import graphgear
    from graphgear.bench.toy_decoder import ToyDecoder

    torch._dynamo.reset()
    graphgear.reset()
    torch.manual_seed(0)
    base = ToyDecoder().cuda().eval()
    models = {k: ToyDecoder().cuda().eval() for k in ("eager", "torch-ro", "graphgear", "piecewise")}
    for m in models.values():
        m.load_state_dict(base.state_dict())
    config = graphgear.CompilerConfig()
    config.mode = "reduce-overhead"
    pieces = graphgear.CompilerConfig()
    pieces.mode = "reduce-overhead"
    pieces.capture_config.mode = "piecewise"
    pieces.capture_config.split_ops = SDPA_CUDA
    fns = {
        "eager": models["eager"],
        "torch-ro": torch.compile(models["torch-ro"], mode="reduce-overhead"),
        "graphgear": torch.compile(models["graphgear"], backend=graphgear.get_backend(config)),
        "piecewise": torch.compile(models["piecewise"], backend=graphgear.get_backend(pieces)),
    }
    max_pos = base.cfg.max_seq_len
    res: dict[str, tuple[float, list[int]]] = {}
    with torch.no_grad():
        for name, fn in fns.items():
            t0 = time.perf_counter()
            decode(fn, 4, max_pos, batch)  # compile, warm up, capture
            models[name].reset_cache()
            print(f"{name:10s} first steps: {time.perf_counter() - t0:6.1f} s", flush=True)
        for name, fn in fns.items():
            models[name].reset_cache()
            res[name] = decode(fn, min(steps, max_pos), max_pos, batch)
            best = res[name][0]
            for _ in range(3):  # best of a few runs: the GPU is ours, noise is the host
                models[name].reset_cache()
                best = min(best, decode(fn, min(steps, max_pos), max_pos, batch)[0])
            res[name] = (best, res[name][1])
    same = res["graphgear"][1] == res["eager"][1] == res["torch-ro"][1]
    e, t, g, p = res["eager"][0], res["torch-ro"][0], res["graphgear"][0], res["piecewise"][0]
    print(f"\ndecoder step on {torch.cuda.get_device_name()}, batch {batch}")
    print(f"{'':34s}{'us/step':>10s}{'vs eager':>10s}{'vs torch-ro':>13s}")
    for label, v in (("eager", e), ("torch.compile reduce-overhead", t), ("graphgear-reduce-overhead", g),
                     ("graphgear-piecewise", p)):
        print(f"{label:34s}{v * 1e6:10.1f}{v / e:10.2f}{v / t:13.2f}")
    for rec in [r for r in graphgear.stats().graphs if r.mode == "reduce-overhead"]:
        print(f"{rec.name}: captures={rec.captures} replays={rec.replays} pieces={len(rec.pieces)} "
              f"splits={[op for op, _ in rec.splits]} fallbacks={rec.fallbacks}")
    print(f"piecewise tokens agree with eager: {res['piecewise'][1] == res['eager'][1]} (reported, no target)")
    ok = same and g <= t and e / g >= 5.0
    print(f"tokens agree: {same}; graphgear <= 1.0x torch-ro: {g <= t}; >= 5x eager: {e / g >= 5.0}")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--skip-tests", action="store_true")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing to check, "
              "skipping. Run it on a machine with a GPU.")
        return 0
    ok_tests = True if a.skip_tests else run_tests()
    # the design's targets are for batch 1; larger batches are reported
    ok_bench = [bench(a.steps, b) for b in a.batch_sizes][0]
    print(f"\ngpu_check: tests {'PASS' if ok_tests else 'FAIL'}, benchmark {'PASS' if ok_bench else 'FAIL'}")
    return 0 if ok_tests and ok_bench else 1


if __name__ == "__main__":
    sys.exit(main())

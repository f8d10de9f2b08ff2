"""Ready-to-serve time of a fresh process (interpreter start to the first correct output,
every gear built first) for the embedded decoder, reduce-overhead, 7 gears:

- graphgear through ``graphgear.inference.cache_compile``, second process (cache hit);
- graphgear without the cache (plain ``torch.compile(backend=graphgear)``);
- ``torch.compile`` default (Inductor), warm Inductor cache.

Every contender runs once untimed first (warms Inductor's on-disk cache and, for the
compile cache, stores the entry), then ``--repeats`` fresh processes are timed; medians
and ratios printed. Usage: ``python benchmarks/bench_cache.py [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from graphgear.cachedir import use_private_inductor_cache

use_private_inductor_cache()  # the worker processes inherit the private Inductor cache

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "cache_worker.py"
GEARS = "1,2,3,4,5,6,8"


def run(cache_dir: str, *extra: str) -> tuple[float, dict[str, object]]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, str(WORKER), "--cache-dir", cache_dir, "--gears", GEARS,
                        "--precompile", *extra], capture_output=True, text=True, env=env, check=True)
    wall = time.perf_counter() - t0
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return wall, json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    cache_dir = tempfile.mkdtemp(prefix="graphgear-bench-cache-")
    contenders = {"graphgear + cache (hit)": (), "graphgear, no cache": ("--no-cache",),
                  "torch.compile default": ("--torch-default",)}
    results: dict[str, list[float]] = {}
    shas: dict[str, str] = {}
    for name, extra in contenders.items():
        run(cache_dir, *extra)  # warm-up: Inductor's cache; the compile cache's entry
        walls = []
        for _ in range(a.repeats):
            wall, out = run(cache_dir, *extra)
            walls.append(wall)
            shas[name] = str(out["sha"])
            if "cache" in name:
                print(f"  ({name}: stats cache fields {out['cache']})")
        results[name] = walls
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"embedded decoder, reduce-overhead, gears {GEARS}; fresh process to first output "
          f"(median of {a.repeats}, seconds, wall incl. interpreter start)")
    for k, v in med.items():
        print(f"  {k:28s} {v:6.2f} s")
    hit = med["graphgear + cache (hit)"]
    print(f"  cache / graphgear no cache:    {hit / med['graphgear, no cache']:.2f}x (goal <= 0.25x)")
    print(f"  cache / torch.compile default: {hit / med['torch.compile default']:.2f}x (goal <= 1.0x)")
    print(f"  outputs equal (graphgear cache vs no cache): "
          f"{shas['graphgear + cache (hit)'] == shas['graphgear, no cache']}")


if __name__ == "__main__":
    main()

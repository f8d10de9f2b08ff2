"""Ready-to-serve time of a fresh process (interpreter start to the first correct output,
every gear built first) for two models:

- the embedded decoder, reduce-overhead, 7 gears (1..8);
- a transformers Llama (small config, random weights), reduce-overhead, 4 gears (1, 2, 4, 8);

each served by (``--mode``: graphgear's mode)

- ``graphgear-<mode> cache hit``: ``graphgear.inference.cache_compile``, second process;
- ``graphgear-<mode> no cache``: plain ``torch.compile(backend=graphgear)``;
- ``torch.compile`` (its default, Inductor), warm Inductor and AOTAutograd caches, one
  call per gear size (its recompiles included).

Ratios are speedups (the reference's seconds / the hit's: higher is better).

Time to first output is measured from spawning the process to the worker's READY line
(printed as soon as the first output is correct); the process's exit after it (Inductor's
worker pool and interpreter teardown) is printed apart and not counted. Every contender
runs once untimed first (warms Inductor's on-disk cache and, for the
compile cache, stores the entry), then ``--repeats`` fresh processes are timed, the
contenders interleaved; medians and the speedups printed in one run. The hit's outputs are
checked bit for bit against the storing process's. ``--mode max-autotune`` runs the same
in that mode. Usage: ``python benchmarks/bench_cache.py [--repeats 3] [--models decoder llama]``.

``--patterns method``: TorchAir's pattern (a module wrapping its own bound method in
``__init__``, tests/models/cache_users.py), 3 gears arriving one call at a time: the
seconds from ``import graphgear`` to the last gear's first output, a storing first process
(empty cache folder, warm Inductor cache) against a second process that hits, side by
side in one run (goal: the second's speedup vs the first >= 2.0x, higher is better).
``--patterns host-read``: a step with ``.item()`` in the middle (captured in two pieces per
gear in reduce-overhead), timed the same way. ``--patterns hf-static-cache``: a transformers
Llama's first three decode steps with a ``StaticCache`` (two entries: before and after the
cache made its tensors).
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
from typing import Any

from graphgear.cache.store import use_private_inductor_cache

use_private_inductor_cache()  # the worker processes inherit the private Inductor cache

from graphgear.bench.names import TORCH_COMPILE, speedup_label  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "cache_worker.py"
MODELS = {"decoder": ("1,2,3,4,5,6,8", "4"), "llama": ("1,2,4,8", "4")}
HIT, NO_CACHE = "cache hit", "no cache"  # graphgear-<mode> ...: see contenders()


def contenders(mode: str) -> dict[str, tuple[str, ...]]:
    """The contenders' names and their worker arguments: graphgear in ``mode`` with the
    cache (hit) and without, and torch.compile."""
    return {f"graphgear-{mode} {HIT}": (), f"graphgear-{mode} {NO_CACHE}": ("--no-cache",),
            TORCH_COMPILE: ("--torch-default",)}


def run(cache_dir: str, model: str, mode: str, *extra: str) -> tuple[float, dict[str, Any]]:
    """One fresh worker process; returns the seconds from spawning it to its first
    correct output (its READY line: interpreter start and imports included, the process's
    exit not) and its RESULT record (with ``exit_s``, the seconds it took to end after)."""
    gears, batch = MODELS[model]
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    with tempfile.TemporaryFile("w+") as errf:  # a file, not a pipe: its log cannot fill up and block
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, str(WORKER), "--cache-dir", cache_dir, "--model", model,
                              "--mode", mode, "--gears", gears, "--batch", batch, "--precompile", *extra],
                             stdout=subprocess.PIPE, stderr=errf, text=True, env=env)
        assert p.stdout is not None
        ready = None
        lines = []
        for ln in p.stdout:
            lines.append(ln)
            if ready is None and ln.startswith("READY"):
                ready = time.perf_counter() - t0
        p.wait()
        end = time.perf_counter() - t0
        errf.seek(0)
        err = errf.read()
    if p.returncode != 0 or ready is None:
        raise RuntimeError(f"worker failed ({model}, {extra}):\n{err[-3000:]}")
    line = [ln for ln in lines if ln.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    out["exit_s"] = end - ready
    return ready, out


def bench(model: str, mode: str, repeats: int) -> dict[str, float]:
    cache_dir = tempfile.mkdtemp(prefix="graphgear-bench-cache-")  # mode 0700
    named = contenders(mode)
    hit, nocache = f"graphgear-{mode} {HIT}", f"graphgear-{mode} {NO_CACHE}"
    first: dict[str, Any] = {}
    for name, extra in named.items():  # warm-up; the cache's first process stores the entry
        first[name] = run(cache_dir, model, mode, *extra)[1]
    walls: dict[str, list[float]] = {k: [] for k in named}
    after_imports: dict[str, list[float]] = {k: [] for k in named}
    exits: dict[str, list[float]] = {k: [] for k in named}
    compile_phase: dict[str, list[float]] = {k: [] for k in named}  # after imports and the model's build
    for _ in range(repeats):
        for name, extra in named.items():
            wall, out = run(cache_dir, model, mode, *extra)
            walls[name].append(wall)
            after_imports[name].append(out["ready_s"] - out["imports_s"])
            compile_phase[name].append(out["ready_s"] - out["imports_s"] - out["model_s"])
            exits[name].append(out["exit_s"])
            if name == hit:
                assert out["cache"] and set(out["cache"]) == {"hit"}, out
                assert out["sha"] == first[name]["sha"], "hit output differs from the storing process's"
                print(f"  ({model}: hit: AOTAutograd compiles {out['aot_compiles']}, Inductor compiles "
                      f"{out['inductor_compiles']}, graphgear compiles {out['compiles']}, keys loaded "
                      f"{out['loaded_keys']}, entry load {out['load_s'][0]:.2f} s)")
    med = {k: statistics.median(v) for k, v in walls.items()}
    med_after = {k: statistics.median(v) for k, v in after_imports.items()}
    gears = MODELS[model][0]
    print(f"{model}, {mode}, gears {gears}: fresh process to first output, median of {repeats} "
          f"(s from spawning the process, interpreter start and imports included | s after imports "
          f"| s the process then took to exit, not counted)")
    for k in named:
        print(f"  {k:40s} {med[k]:6.2f} s | {med_after[k]:6.2f} s | {statistics.median(exits[k]):5.2f} s")
    s_gg = med[nocache] / med[hit]
    s_tc = med[TORCH_COMPILE] / med[hit]
    print(f"  cache hit, {speedup_label(NO_CACHE)}:      {s_gg:.2f}x to first output, "
          f"{med_after[nocache] / med_after[hit]:.2f}x after imports (goal >= 4.0x)")
    print(f"  cache hit, {speedup_label(TORCH_COMPILE)}: {s_tc:.2f}x to first output, "
          f"{med_after[TORCH_COMPILE] / med_after[hit]:.2f}x after imports (goal >= 1.0x)")
    med_c = {k: statistics.median(v) for k, v in compile_phase.items()}
    print(f"  after imports and the model's build: hit {med_c[hit]:.2f} s, no cache "
          f"{med_c[nocache]:.2f} s, torch.compile {med_c[TORCH_COMPILE]:.2f} s: the hit's "
          f"{speedup_label(NO_CACHE)} {med_c[nocache] / med_c[hit]:.2f}x, "
          f"{speedup_label(TORCH_COMPILE, direction=False)} {med_c[TORCH_COMPILE] / med_c[hit]:.2f}x")
    print(f"  hit outputs equal the storing process's bit for bit: True; graphgear no cache equal too: "
          f"{first[hit]['sha'] == first[nocache]['sha']}")
    return {"hit_speedup_vs_no_cache": s_gg, "hit_speedup_vs_torch_compile": s_tc}


PATTERNS_WORKER = ROOT / "tests" / "cache_patterns_worker.py"


def bench_pattern(pattern: str, mode: str, repeats: int) -> float:
    """First (storing) vs second (hit) process of one cache_compile pattern."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")

    def one(folder: str) -> dict[str, Any]:
        p = subprocess.run([sys.executable, str(PATTERNS_WORKER), pattern, "--mode", mode, "--dir", folder,
                            "--sizes", "4,2,8", "--gears", "2,4,8"], capture_output=True, text=True, env=env)
        if p.returncode != 0:
            raise RuntimeError(p.stderr[-3000:])
        return json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])

    one(tempfile.mkdtemp(prefix="graphgear-bench-cache-"))  # warms Inductor's on-disk cache
    firsts, seconds = [], []
    for _ in range(repeats):
        folder = tempfile.mkdtemp(prefix="graphgear-bench-cache-")
        first, second = one(folder), one(folder)
        assert second["records"] and all(r["cache"] == "hit" for r in second["records"]), second
        assert second["unique_graphs"] == 0, second
        assert [c["sha"] for c in first["calls"]] == [c["sha"] for c in second["calls"]]
        firsts.append(first["ready_s"])
        seconds.append(second["ready_s"])
    f, s2 = statistics.median(firsts), statistics.median(seconds)
    what = ("3 decode steps" if pattern == "hf-static-cache"
            else "gears 2,4,8 arriving one call at a time")
    print(f"{pattern} pattern, {mode}, {what}: import graphgear to the "
          f"last call's output, median of {repeats}: first process (stores) {f:.2f} s, second "
          f"(hit) {s2:.2f} s: the second's {speedup_label('the first')} {f / s2:.2f}x (goal >= 2.0x)")
    return f / s2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["decoder", "llama"])
    ap.add_argument("--mode", default="reduce-overhead", choices=["reduce-overhead", "max-autotune"])
    ap.add_argument("--patterns", nargs="*", default=[],
                    choices=["method", "function", "module", "host-read", "hf-static-cache"],
                    help="time cache_compile patterns (first vs second process) instead of --models")
    a = ap.parse_args()
    if a.patterns:
        for pattern in a.patterns:
            bench_pattern(pattern, a.mode, a.repeats)
        return
    for model in a.models:
        bench(model, a.mode, a.repeats)


if __name__ == "__main__":
    main()

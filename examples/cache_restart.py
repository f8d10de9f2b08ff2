"""A restart served from graphgear's compile cache.

    python examples/cache_restart.py [--mode reduce-overhead|max-autotune]

The script runs itself twice, as two fresh processes sharing a new temporary cache
folder (``--phase store``, then ``--phase load``; deleted at the end). Each builds the
same model (``examples/cache_model.py``: the class lives in a module of its own, which
the cache needs) and wraps it whole with ``graphgear.inference.cache_compile``. The
batch dim gets the gears 2, 4 and 8, set on the first call's tokens; batches of 4, 2
and 8 then arrive one call at a time as plain tensors. The first process compiles every
gear and stores the entry (``graphgear.stats()``: ``cache="stored"``); the second loads
it (``cache="hit"``: no dynamo trace, no AOTAutograd trace, no Inductor compile) and
must produce outputs bit for bit equal to the first's, both close to eager's (asserted).
The seconds each process took are printed for information only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from graphgear.cache.store import use_private_inductor_cache

use_private_inductor_cache()  # Inductor's on-disk cache in a folder private to this user

import torch  # noqa: E402

import graphgear  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # examples/, for cache_model
import cache_model  # noqa: E402

GEARS = [2, 4, 8]
BATCHES = [4, 2, 8]
TOL = dict(rtol=1e-4, atol=1e-5)


def phase(mode: str, folder: str) -> dict[str, Any]:
    """One process's work: serve ``BATCHES`` through the cache in ``folder``."""
    t0 = time.perf_counter()
    model = cache_model.build()
    config = graphgear.CompilerConfig()
    config.mode = mode
    served = graphgear.inference.cache_compile(model, config=config, cache_dir=folder)
    calls = []
    for i, batch in enumerate(BATCHES):
        tokens = torch.randint(0, cache_model.VOCAB, (batch, cache_model.SEQ),
                               generator=torch.Generator().manual_seed(batch))
        if i == 0:
            graphgear.set_dim_gears(tokens, {0: GEARS})  # holds for the later calls' tokens too
        out = served(tokens)
        with torch.no_grad():
            want = model(tokens)
        torch.testing.assert_close(out, want, **TOL, msg=lambda m, b=batch: f"batch {b}: output differs from eager's\n{m}")
        calls.append({"batch": batch, "sha256": hashlib.sha256(out.contiguous().numpy().tobytes()).hexdigest(),
                      "max_diff": float((out - want).abs().max())})
    seconds = time.perf_counter() - t0
    print(graphgear.stats(), file=sys.stderr)
    records = [{"name": g.name, "cache": g.cache, "reason": g.cache_reason, "loaded_keys": g.loaded_keys,
                "compiles": g.compiles, "captures": g.captures, "load_s": g.cache_load_seconds}
               for g in graphgear.stats().graphs]
    return {"calls": calls, "records": records, "seconds": seconds}


def spawn(which: str, mode: str, folder: str) -> tuple[dict[str, Any], float]:
    """Run ``--phase which`` in a fresh interpreter; its JSON result and wall seconds."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--phase", which, "--mode", mode,
                        "--dir", folder], capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    assert p.returncode == 0, f"the {which} process failed (exit {p.returncode}):\n{p.stderr[-4000:]}"
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"the {which} process printed no result:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    return json.loads(lines[-1]), wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("reduce-overhead", "max-autotune"), default="reduce-overhead")
    p.add_argument("--phase", choices=("store", "load"), help="run one process's part (the script spawns these)")
    p.add_argument("--dir", help="the cache folder (with --phase)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.phase is not None:
        assert args.dir, "--phase needs --dir"
        print(json.dumps(phase(args.mode, args.dir)))
        return

    with tempfile.TemporaryDirectory(prefix="graphgear-cache-") as folder:  # mode 0700, ours
        first, first_wall = spawn("store", args.mode, folder)
        second, second_wall = spawn("load", args.mode, folder)
    stored = [r["cache"] for r in first["records"]]
    loaded = [r["cache"] for r in second["records"]]
    assert stored == ["stored"], f"the first process should compile and store one graph, got {first['records']}"
    assert loaded == ["hit"], f"the second process should be served from the cache, got {second['records']}"
    assert first["records"][0]["compiles"] == len(GEARS), f"expected one compile per gear, got {first['records']}"
    (hit,) = second["records"]
    assert hit["loaded_keys"] == len(GEARS), f"expected every gear loaded, got {hit}"
    assert hit["compiles"] == 0, f"the second process compiled a gear: {hit}"
    for a, b in zip(first["calls"], second["calls"]):
        assert a["sha256"] == b["sha256"], f"batch {a['batch']}: the second process's output differs from the first's"
    print(f"{args.mode}: first process compiled and stored {len(GEARS)} gears (cache={stored[0]!r}); "
          f"second process: cache={loaded[0]!r}, {hit['loaded_keys']} gears loaded in {hit['load_s']:.2f} s, "
          f"0 compiles; outputs at batches {BATCHES} bit for bit equal to the first's, max abs diff to "
          f"eager {max(c['max_diff'] for c in second['calls']):.1e}")
    print(f"seconds, model built to last output (process wall): store {first['seconds']:.1f} "
          f"({first_wall:.1f}), load {second['seconds']:.1f} ({second_wall:.1f}); information only")
    print("ok")


if __name__ == "__main__":
    main()

"""Shape churn: 64 distinct batch sizes (1..64, shuffled) through the embedded decoder.

Side by side in one process, on the same stream of sizes, each contender asked for:
- ``graphgear-max-autotune`` / ``graphgear-reduce-overhead``: gears [1, 2, 4, ..., 64] and
  gear_padding,
- ``torch.compile``: its defaults (Inductor, automatic dynamic shapes),
- ``torch.compile-dynamic``: ``torch.compile(dynamic=True)``.
Every step starts from an empty KV cache (``reset_cache()``), so each is an independent
request (graphgear puts back the cache slots a padded call's pad rows wrote: see
docs/concepts/gears.md, "Padding"). Prints, per contender: graphs compiled, dynamo recompiles, eager fallbacks (frames
dynamo gave up on, graphgear fallbacks), total seconds for the whole stream (compile
time included), and the max abs difference from eager.

    python benchmarks/bench_gears.py [--contenders graphgear-max-autotune torch.compile ...]
"""

from __future__ import annotations

import argparse
import copy
import random
import time

from graphgear.cache.store import use_private_inductor_cache  # noqa: E402

use_private_inductor_cache()  # before torch: importing torch._dynamo fixes the cache folder

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import graphgear  # noqa: E402
from graphgear.bench.names import CONTENDERS as NAMES  # noqa: E402
from graphgear.bench.names import name_type  # noqa: E402
from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder  # noqa: E402

GEARS = [1, 2, 4, 8, 16, 32, 64]
TORCH_COMPILE, MAX_AUTOTUNE, REDUCE_OVERHEAD = NAMES[1:4]
TORCH_COMPILE_DYNAMIC = "torch.compile-dynamic"  # torch.compile(dynamic=True)
CONTENDERS = (MAX_AUTOTUNE, REDUCE_OVERHEAD, TORCH_COMPILE, TORCH_COMPILE_DYNAMIC)
MODES = {MAX_AUTOTUNE: "max-autotune", REDUCE_OVERHEAD: "reduce-overhead"}


def run(name: str, model: torch.nn.Module, sizes: list[int], ref: dict[int, torch.Tensor]) -> dict:
    graphgear.reset()
    counters.clear()
    if name in MODES:
        cfg = graphgear.CompilerConfig()
        cfg.mode = MODES[name]
        cfg.inference_config.gear_padding = True
        fn = torch.compile(model, backend=graphgear.get_backend(compiler_config=cfg))
    elif name == TORCH_COMPILE_DYNAMIC:
        fn = torch.compile(model, dynamic=True)
    else:
        fn = torch.compile(model)
    diff = 0.0
    t0 = time.perf_counter()
    with torch.no_grad():
        for i, b in enumerate(sizes):
            model.reset_cache()
            tok = torch.full((b, 1), 3, dtype=torch.long)
            if name.startswith("graphgear"):
                graphgear.set_dim_gears(tok, {0: GEARS})
            try:
                out = fn(tok, torch.tensor([i % model.cfg.max_seq_len]))
            except graphgear.GraphgearError as e:  # e.g. padding refused: say so, go on with the next
                return {"contender": name, "error": f"batch {b} (call {i + 1}): {type(e).__name__}: {e}"}
            diff = max(diff, float((out - ref[i]).abs().max()))
    total = time.perf_counter() - t0
    stats = graphgear.stats()
    if name.startswith("graphgear"):
        graphs = sum(g.compiles for g in stats.graphs)
        fallbacks = sum(len(g.fallbacks) for g in stats.graphs)
    else:
        graphs = counters["stats"]["unique_graphs"]
        fallbacks = 0
    recompiles = max(0, counters["stats"]["unique_graphs"] - 1)
    fallbacks += counters["frames"].get("total", 0) - counters["frames"].get("ok", 0)
    return {"contender": name, "graphs": graphs, "recompiles": recompiles, "fallbacks": fallbacks,
            "seconds": total, "max_abs_diff": diff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contenders", nargs="+", type=name_type(CONTENDERS),
                   default=[MAX_AUTOTUNE, TORCH_COMPILE, TORCH_COMPILE_DYNAMIC],
                   help=f"space-separated, out of: {', '.join(CONTENDERS)}")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    sizes = list(range(1, 65))
    random.Random(args.seed).shuffle(sizes)
    base = ToyDecoder(DecoderConfig(max_batch_size=64)).eval()
    eager = copy.deepcopy(base)
    ref = {}
    with torch.no_grad():
        for i, b in enumerate(sizes):
            eager.reset_cache()
            ref[i] = eager(torch.full((b, 1), 3, dtype=torch.long), torch.tensor([i % base.cfg.max_seq_len]))
    contenders = list(dict.fromkeys(args.contenders))
    rows = [run(c, copy.deepcopy(base), sizes, ref) for c in contenders]
    print(f"64 distinct batch sizes, shuffled; graphgear gears {GEARS} with padding")
    print(f"{'contender':<30} {'graphs':>6} {'recompiles':>10} {'fallbacks':>9} {'seconds':>8} {'max diff':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['contender']:<30} refused, {r['error']}")
            continue
        print(f"{r['contender']:<30} {r['graphs']:>6} {r['recompiles']:>10} {r['fallbacks']:>9} "
              f"{r['seconds']:>8.1f} {r['max_abs_diff']:>9.1e}")


if __name__ == "__main__":
    main()

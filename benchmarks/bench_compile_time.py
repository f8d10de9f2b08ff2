"""Time to the first output: ``torch.compile`` and both graphgear modes at 2, 8 and 24 layers.

    python benchmarks/bench_compile_time.py [--layers 2 8 24] [--batch 1] [--dtype bfloat16]
        [--vocab 151936] [--contenders torch.compile max-autotune reduce-overhead]
        [--no-regions] [--gears 1 2 4 8] [--json FILE]

A transformers Qwen2 of Qwen2.5-0.5B's widths (hidden 896, 14 heads, 2 KV heads, MLP
4864, tied embeddings; random weights, built from a config) with ``--layers`` decoder
layers, one decode step over a ``StaticCache`` of 64 positions. Each figure comes from a
fresh process (nothing of an earlier compile in memory), one after another:

* **cold**: a new, empty Inductor cache folder: everything is generated and built;
* **warm**: a second process on the folder the cold one filled (what a restart, or a
  developer's second run, costs).

The time is the wall time from the first call to its output, for reduce-overhead to
the output of the call that captured (its first ``warmup_iters + 1`` calls: a
reduce-overhead graph captures on the call after its warm-up run). ``--no-regions``
runs graphgear with ``experimental_config.repeated_regions = False`` beside it, so the
effect of compiling a repeated layer once is measured side by side. The last columns are
the 24-layer (largest) time over the 2-layer (smallest) one, per contender and cache, and
the largest model's cold time over ``torch.compile``'s.

``--gears 1 2 4 8`` measures what a server waits for before it serves every batch size:
graphgear's own decoder (:mod:`graphgear.bench.toy_decoder`, the same widths, one KV
cache for every batch size, so the batch is one dynamic dim with gears) from the first
call to every gear compiled and captured (``graphgear.inference.precompile_gears``),
against ``torch.compile``'s first call of one batch size (the largest gear).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from graphgear.cache.store import inductor_cache_dir, use_private_inductor_cache  # noqa: E402

use_private_inductor_cache()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CONTENDERS = ("torch.compile", "max-autotune", "reduce-overhead")


def _child_gears(args: argparse.Namespace) -> dict[str, Any]:
    """``--gears``: graphgear's own decoder at the same widths (one model and KV cache for
    every batch size), the time from the first call to every gear built and captured
    (``precompile_gears``); ``torch.compile``: its first call at the largest gear."""
    import torch

    import graphgear
    from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=args.vocab, hidden_size=896, num_layers=args.layers[0], num_heads=14,
                        intermediate_size=4864, max_seq_len=64, max_batch_size=max(args.gears))
    model = ToyDecoder(cfg).eval().to(getattr(torch, args.dtype))
    tokens = torch.zeros(max(args.gears), 1, dtype=torch.long)
    position = torch.tensor([0])
    contender = args.contenders[0]
    with torch.no_grad():
        t0 = time.perf_counter()
        if contender == "torch.compile":
            torch.compile(model)(tokens, position)
        else:
            mode, _, regions = contender.partition("/")
            cfg_gg = graphgear.CompilerConfig()
            cfg_gg.mode = mode
            cfg_gg.experimental_config.repeated_regions = regions != "no-regions"
            graphgear.set_dim_gears(tokens, {0: list(args.gears)})
            graphgear.inference.precompile_gears(torch.compile(model, backend=graphgear.get_backend(cfg_gg)),
                                                 tokens, position)
        first = time.perf_counter() - t0
    rec = graphgear.stats().graphs[-1] if graphgear.stats().graphs else None
    return {"first_s": first, "regions": dict(rec.regions) if rec else {},
            "compiles": rec.compiles if rec else 0, "captures": rec.captures if rec else 0}


def _child(args: argparse.Namespace) -> dict[str, Any]:
    """One contender's first output, in this (fresh) process."""
    if args.gears:
        return _child_gears(args)
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, StaticCache

    import graphgear

    torch.set_num_threads(args.threads)
    cfg = Qwen2Config(hidden_size=896, num_hidden_layers=args.layers[0], num_attention_heads=14,
                      num_key_value_heads=2, intermediate_size=4864, vocab_size=args.vocab,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(cfg).eval().to(getattr(torch, args.dtype))
    cache = StaticCache(config=cfg, max_cache_len=64)

    def step(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        ids = position.view(1, 1).expand(tokens.shape[0], 1)
        return lm(input_ids=tokens, past_key_values=cache, position_ids=ids, use_cache=True).logits

    tokens = torch.zeros(args.batch, 1, dtype=torch.long)
    with torch.no_grad():
        step(tokens, torch.tensor([0]))  # sizes the cache's tensors before any compile sees them
        cache.reset()
    contender = args.contenders[0]
    if contender == "torch.compile":
        fn, calls = torch.compile(step), 1
    else:
        mode, _, regions = contender.partition("/")
        cfg_gg = graphgear.CompilerConfig()
        cfg_gg.mode = mode
        cfg_gg.experimental_config.repeated_regions = regions != "no-regions"
        fn = torch.compile(step, backend=graphgear.get_backend(cfg_gg))
        calls = cfg_gg.capture_config.warmup_iters + 1 if mode == "reduce-overhead" else 1
    with torch.no_grad():
        t0 = time.perf_counter()
        for i in range(calls):
            fn(tokens, torch.tensor([i]))
        first = time.perf_counter() - t0
    regions = {k: v for g in graphgear.stats().graphs for k, v in g.regions.items()}
    return {"first_s": first, "regions": regions}


def _run(args: argparse.Namespace, contender: str, layers: int, cache_dir: str) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--contenders", contender, "--layers", str(layers),
           "--batch", str(args.batch), "--dtype", args.dtype, "--vocab", str(args.vocab),
           "--threads", str(args.threads)] + (["--gears", *map(str, args.gears)] if args.gears else [])
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{contender} at {layers} layers failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8, 24])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS))
    p.add_argument("--no-regions", action="store_true",
                   help="also run each graphgear mode with repeated_regions off")
    p.add_argument("--gears", type=int, nargs="*", default=[],
                   help="graphgear's own decoder at these widths with these gears (one KV cache for "
                        "every batch): graphgear's time to every gear built and captured, against "
                        "torch.compile's first call at the largest gear")
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args)), flush=True)
        return
    contenders = list(args.contenders)
    if args.no_regions:
        contenders += [f"{c}/no-regions" for c in args.contenders if c != "torch.compile"]
    root = os.path.join(os.path.dirname(inductor_cache_dir()), "bench-compile-time")
    os.makedirs(root, 0o700, exist_ok=True)
    rows: list[dict[str, Any]] = []
    if args.gears:
        print(f"graphgear's decoder at Qwen2.5-0.5B's widths, vocab {args.vocab}, {args.dtype}, gears "
              f"{args.gears}, {args.threads} thread(s); seconds from the first call to every gear built "
              f"and captured (torch.compile: its first call at batch {max(args.gears)}), each in a fresh "
              "process", flush=True)
    else:
        print(f"Qwen2 widths of Qwen2.5-0.5B, vocab {args.vocab}, {args.dtype}, batch {args.batch}, "
              f"{args.threads} thread(s); seconds from the first call to its output (reduce-overhead: to "
              "the captured output), each in a fresh process", flush=True)
    for layers in args.layers:
        for contender in contenders:
            folder = tempfile.mkdtemp(prefix="cold-", dir=root)
            try:
                cold = _run(args, contender, layers, folder)
                warm = _run(args, contender, layers, folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            row = {"layers": layers, "contender": contender, "cold_s": cold["first_s"], "warm_s": warm["first_s"],
                   "regions": cold["regions"], "compiles": cold.get("compiles"), "captures": cold.get("captures")}
            rows.append(row)
            print(f"  {layers:3d} layers  {contender:32s} cold {row['cold_s']:7.1f} s   warm {row['warm_s']:6.1f} s"
                  f"   regions {row['regions'] or '-'}"
                  + (f"   compiles {row['compiles']}, captures {row['captures']}" if args.gears else ""),
                  flush=True)
    print()
    print(f"{'contender':32s} {'cold, largest/smallest':>24s} {'warm, largest/smallest':>24s} {'cold vs torch.compile':>22s}")
    lo, hi = min(args.layers), max(args.layers)
    by = {(r["layers"], r["contender"]): r for r in rows}
    for contender in contenders:
        a, b = by[(lo, contender)], by[(hi, contender)]
        ref = by.get((hi, "torch.compile"))
        vs = f"{b['cold_s'] / ref['cold_s']:.2f}x" if ref else "-"
        print(f"{contender:32s} {b['cold_s'] / a['cold_s']:23.2f}x {b['warm_s'] / a['warm_s']:23.2f}x {vs:>22s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

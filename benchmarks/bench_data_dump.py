"""What ``debug.data_dump`` costs (issue 37): a 2-layer transformers Llama step (small
config, random weights, one sequence of 8 tokens, no KV cache) through graphgear in
``--mode``, side by side in one run:

- ``dump off``: the default config;
- ``dump off, options set``: ``debug.data_dump.path``/``ops``/``nodes`` set, ``enabled``
  False (the options cost nothing unless the dump is on: the check is at compile time);
- ``dump on``: every call dumps the selected nodes (``--ops``, default ``aten.mm``); the
  graph then runs op by op, so this row is slower by design.

Median per-step milliseconds over ``--steps`` steps in ``--rounds`` interleaved rounds,
and each row's ratio to ``dump off`` (lower is better). Usage:
``python benchmarks/bench_data_dump.py [--mode max-autotune] [--steps 200] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

from graphgear.cache.store import use_private_inductor_cache

use_private_inductor_cache()  # before torch: importing torch._dynamo fixes the cache folder
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import graphgear  # noqa: E402


def _model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", default="max-autotune", choices=["max-autotune", "reduce-overhead"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ops", nargs="+", default=["aten.mm"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = _model()
    ids = torch.randint(0, 512, (1, 8))
    tmp = tempfile.mkdtemp(prefix="graphgear-dump-bench-")
    configs = {
        "dump off": {"mode": args.mode},
        "dump off, options set": {"mode": args.mode, "data_dump_dir": tmp, "ops": args.ops, "nodes": ["mm*"]},
        "dump on": {"mode": args.mode, "dump_tensor_data": True, "data_dump_dir": tmp, "ops": args.ops},
    }
    fns: dict[str, Callable[[], Any]] = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "options set" warns that they have no effect: expected
        ref = model(input_ids=ids, use_cache=False).logits
        for name, options in configs.items():
            compiled = torch.compile(lambda i: model(input_ids=i, use_cache=False).logits,
                                     backend=graphgear.get_backend(), options=options)
            out = compiled(ids)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            fns[name] = lambda c=compiled: c(ids)
        times: dict[str, list[float]] = {n: [] for n in fns}
        per_round = max(1, args.steps // args.rounds)
        for _ in range(args.rounds):
            for name, fn in fns.items():
                steps = per_round if name != "dump on" else max(1, per_round // 10)
                for _ in range(3):
                    fn()
                for _ in range(steps):
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["dump off"])
    print(f"graphgear data dump cost: transformers Llama 2 layers, hidden 128, 8 tokens, mode {args.mode}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{'config':<24}{'median ms':>10}{'vs dump off (lower is better)':>32}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<24}{med * 1e3:>10.3f}{med / base:>31.2f}x")


if __name__ == "__main__":
    main()

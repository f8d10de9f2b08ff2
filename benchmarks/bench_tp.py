"""Tensor-parallel decode steps on 2 gloo ranks (CPU, 1 thread per rank), side by side in one run.

    python benchmarks/bench_tp.py [--tp megatron|dtensor] [--batch-sizes 1 4] [--steps 30]
                                  [--rounds 5] [--json FILE]

The embedded decoder (``graphgear.bench.toy_decoder``, hidden 128, 2 layers) split over 2 ranks
(``graphgear.bench.toy_decoder_tp``: ``megatron`` by hand, or ``dtensor`` with
``torch.distributed.tensor.parallel``). Contenders, each on its own copy of the split
model: ``eager``, ``torch.compile`` (its default, Inductor), ``graphgear-max-autotune``
and ``graphgear-reduce-overhead``. For scale, rank 0 also times the whole model alone
(``eager (1 rank)`` and ``graphgear-reduce-overhead (1 rank)``: no collective) while
rank 1 waits, and both ranks time one gloo all-reduce of a decode step's activations
(the TP model issues 2 per layer). Ratios are speedups vs eager and vs torch.compile
(their step time / the row's: higher is better).

Every contender is compiled and checked first (its logits against the 1-rank eager
model's; ``max diff`` column), then timed in ``--rounds`` interleaved rounds with
rotating order, both ranks starting each block together (a barrier); a cell is the
median over rounds of rank 0's mean step time. Ranks are started with
``torch.multiprocessing`` on 127.0.0.1 and a free port.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from graphgear.cache.store import use_private_inductor_cache

use_private_inductor_cache()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import graphgear  # noqa: E402
from graphgear.bench import toy_decoder_tp  # noqa: E402
from graphgear.bench.names import CONTENDERS, positive_int, speedup_label, speedup_note  # noqa: E402
from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder  # noqa: E402
from graphgear.env import run_metadata  # noqa: E402

WORLD = 2
EAGER, TORCH_COMPILE, MAX_AUTOTUNE, REDUCE_OVERHEAD = CONTENDERS[:4]
TP = (EAGER, TORCH_COMPILE, MAX_AUTOTUNE, REDUCE_OVERHEAD)
ALONE = (f"{EAGER} (1 rank)", f"{REDUCE_OVERHEAD} (1 rank)")
MODES = {MAX_AUTOTUNE: "max-autotune", REDUCE_OVERHEAD: "reduce-overhead"}


def _compile(model: torch.nn.Module, name: str) -> Callable[..., Any]:
    name = name.removesuffix(" (1 rank)")
    if name == EAGER:
        return model
    if name == TORCH_COMPILE:
        return torch.compile(model)
    return torch.compile(model, backend="graphgear", options={"mode": MODES[name]})


def _logits(out: Any) -> torch.Tensor:
    return out.full_tensor() if hasattr(out, "full_tensor") else out


def _rank(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=600))
    cfg = DecoderConfig(max_batch_size=max(args.batch_sizes), max_seq_len=64)
    full = ToyDecoder(cfg).eval()  # the same seed on every rank: the same weights
    results: dict[str, Any] = {"rows": {}, "compile_s": {}, "max_diff": {}}
    with torch.no_grad():
        for bsz in args.batch_sizes:
            tokens = [torch.randint(0, cfg.vocab_size, (bsz, 1), generator=torch.Generator().manual_seed(s))
                      for s in range(args.steps)]
            fns: dict[str, Callable[..., Any]] = {}
            for name in TP + ALONE:
                if name in ALONE:
                    model = ToyDecoder(cfg).eval()
                    model.load_state_dict(full.state_dict())
                elif args.tp == "megatron":
                    model = toy_decoder_tp.megatron(full, rank, WORLD).eval()
                else:
                    model = toy_decoder_tp.dtensor(full, init_device_mesh("cpu", (WORLD,))).eval()
                fn = _compile(model, name)
                alone = name in ALONE
                t0 = time.perf_counter()
                diff = 0.0
                if not alone or rank == 0:
                    for pos in range(3):  # compile (and warm up / capture) here
                        got = _logits(fn(tokens[pos], torch.tensor([pos])))
                        want = full(tokens[pos], torch.tensor([pos]))
                        diff = max(diff, float((got - want).abs().max()))
                dist.barrier()
                results["compile_s"][f"{name} b{bsz}"] = time.perf_counter() - t0
                results["max_diff"][f"{name} b{bsz}"] = diff
                fns[name] = fn
            x = torch.randn(bsz, 1, cfg.hidden_size)
            fns["gloo all_reduce"] = lambda t, p, x=x: dist.all_reduce(x)
            names = list(fns)
            times: dict[str, list[float]] = {n: [] for n in names}
            for r in range(args.rounds):
                order = names[r % len(names):] + names[:r % len(names)]
                for name in order:
                    dist.barrier()
                    if name in ALONE and rank != 0:
                        continue  # rank 1 waits at the next barrier
                    fn = fns[name]
                    t0 = time.perf_counter()
                    for s in range(args.steps):
                        fn(tokens[s], torch.tensor([3 + s]))
                    times[name].append((time.perf_counter() - t0) / args.steps)
            for name in names:
                if times[name]:
                    results["rows"][f"{name} b{bsz}"] = statistics.median(times[name])
            graphgear.reset()
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", choices=("megatron", "dtensor"), default="megatron")
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 4], help="space-separated")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None, help="also write the figures to this file, with the run's versions, "
                                                 "threads, CPU and commit")
    args = p.parse_args()
    if args.steps < 3 or args.rounds < 1:
        p.error(f"--steps must be at least 3 (got {args.steps}) and --rounds at least 1 (got {args.rounds})")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.start_processes(_rank, args=(_free_port(), args, out), nprocs=WORLD, start_method="spawn")
        with open(out) as f:
            res = json.load(f)
    rows = res["rows"]
    print(f"tensor parallel ({args.tp}) over {WORLD} gloo ranks, 1 thread each, torch {torch.__version__}; "
          f"us per decode step (median of {args.rounds} rounds x {args.steps} steps, rank 0)")
    for bsz in args.batch_sizes:
        eager, inductor = rows[f"{EAGER} b{bsz}"], rows[f"{TORCH_COMPILE} b{bsz}"]
        se, stc = speedup_label(EAGER, direction=False), speedup_label(TORCH_COMPILE, direction=False)
        print(f"\nbatch {bsz}")
        print(f"{'contender':<38}{'us/step':>10}{se:>18}{stc:>26}{'compile s':>11}{'max diff':>10}")
        for name in (*TP, *ALONE, "gloo all_reduce"):
            t = rows[f"{name} b{bsz}"]
            comp = res["compile_s"].get(f"{name} b{bsz}")
            diff = res["max_diff"].get(f"{name} b{bsz}")
            print(f"{name:<38}{t * 1e6:>10.0f}{eager / t:>17.2f}x{inductor / t:>25.2f}x"
                  f"{'' if comp is None else f'{comp:.1f}':>11}{'' if diff is None else f'{diff:.1e}':>10}")
    print(speedup_note(EAGER, TORCH_COMPILE))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {**run_metadata(), "threads": 1, "ranks": WORLD}, "args": vars(args), **res}, f,
                      indent=1)


if __name__ == "__main__":
    main()

"""Decode step of a transformers decoder at every batch size, side by side in one run.

    python benchmarks/bench_decode.py [--sizes small large] [--batch-sizes 1 2 4 8]
                                      [--steps 50] [--rounds 5] [--threads 1] [--json FILE]
                                      [--dtype float32|bfloat16] [--contenders NAME ...]

One table per model size. Rows are contenders: ``eager``, ``torch.compile`` (its default,
Inductor), ``graphgear-max-autotune``, ``graphgear-reduce-overhead``,
``graphgear-reduce-overhead-frozen`` (``frozen_parameter``: weights packed as constants),
``graphgear-reduce-overhead-piecewise`` (piecewise capture with attention,
``aten._scaled_dot_product_flash_attention_for_cpu``, in ``split_ops`` and batch gears
1, 2, 4, 8: each layer's attention runs uncaptured between captured pieces)
and ``graphgear-serve`` (``graphgear.inference.serve``: frozen parameters plus the
serving guard filter); columns are batch sizes. Each cell is µs per decode
step and the speedup vs eager (eager's time / the contender's: higher is better); the
last column gives the weight bandwidth at batch 1
(weight bytes read per step / step time) and its share of the machine's single-thread
read bandwidth, measured in the same run (``torch.sum`` over a 100 MB tensor). A last
row gives the roofline floor of a step at each batch: the weights read once at that
bandwidth, or the matrix products' FLOPs at the machine's GEMM rate (a 512-cube ``mm``,
measured in the same run), whichever is longer; each graphgear line says how close to
it a contender gets (floor / time: higher is better). ``--dtype bfloat16`` runs every contender on a bf16
copy of the model (the bandwidth counts bf16 bytes; the GEMM rate is then a bf16 ``mm``,
oneDNN's, on AMX where the CPU has it) and compares the logits with float32 eager's.

Models (transformers Qwen2, random weights, built from a config; nothing is downloaded):
``small`` hidden 256, 4 layers, vocab 2048 (the issue's model); ``large`` hidden 1024, 2
layers, vocab 8192 (about 100 MB of fp32 weights: they leave the caches); ``tiny`` hidden
128, 2 layers (where Python around the kernels dominates).

Every contender compiles its own copy of the weights for each batch size (a fresh
compile: static shapes); timing runs in ``--rounds`` interleaved rounds with rotating
order so machine noise hits all alike; each cell is the median over rounds.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from graphgear.cache.store import use_private_inductor_cache

use_private_inductor_cache()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import graphgear  # noqa: E402
from graphgear.bench.names import CONTENDERS as NAMES  # noqa: E402
from graphgear.bench.names import name_type, positive_int, speedup_label  # noqa: E402
from graphgear.env import run_metadata  # noqa: E402

SIZES = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048),
    "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=2048),
    "large": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=8192),
}
#: the contenders, named as everywhere (graphgear.bench.names), and this benchmark's frozen variant
PIECEWISE = "graphgear-reduce-overhead-piecewise"
CONTENDERS = (*NAMES[:4], "graphgear-reduce-overhead-frozen", PIECEWISE, NAMES[4])
#: the op piecewise capture leaves uncaptured: the attention of every layer
SPLIT_ATTENTION = "aten._scaled_dot_product_flash_attention_for_cpu"
SERVE, SERVE_VIA_DYNAMO = "graphgear-serve", "graphgear-serve-via-dynamo"
MAX_LEN = 64


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build(size: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(max_position_embeddings=512, bos_token_id=1, eos_token_id=None, pad_token_id=0,
                      tie_word_embeddings=False, **SIZES[size])
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval().to(dtype)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every parameter but the embedding table (one row)."""
    emb = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)


def read_bandwidth() -> float:
    """Single-thread read bandwidth in GB/s: ``torch.sum`` over 100 MB, best of 5."""
    x = torch.ones(25 * 2**20)
    best = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def gemm_peak(dtype: torch.dtype = torch.float32) -> float:
    """The machine's matrix-product rate in GFLOP/s at the current thread count: a
    512 x 512 x 512 ``mm`` in ``dtype`` (MKL for fp32, oneDNN for bf16), best of 5."""
    a, b = torch.randn(512, 512, dtype=dtype), torch.randn(512, 512, dtype=dtype)
    best = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        best = min(best, (time.perf_counter() - t0) / 4)
    return 2 * 512**3 / best / 1e9


def floor_us(weight_bytes: int, batch: int, bw: float, peak: float, itemsize: int = 4) -> tuple[float, str]:
    """The roofline of one decode step: reading every weight once at the measured read
    bandwidth, or the matrix products' FLOPs (2 per weight per row) at the measured GEMM
    rate, whichever takes longer; microseconds and which bound it is."""
    read = weight_bytes / (bw * 1e9)
    compute = 2 * batch * (weight_bytes / itemsize) / (peak * 1e9)
    return max(read, compute) * 1e6, "bandwidth" if read >= compute else "compute"


def compiled(name: str, model: torch.nn.Module) -> Callable[..., Any]:
    if name == "eager":
        return model
    if name == "torch.compile":
        return torch.compile(model)
    if name == SERVE:
        return graphgear.inference.serve(model)
    if name == SERVE_VIA_DYNAMO:  # every call through dynamo's frame evaluation
        return graphgear.inference.serve(model, direct=False)
    cfg = graphgear.CompilerConfig()
    cfg.mode = "max-autotune" if name.endswith("max-autotune") else "reduce-overhead"
    if name.endswith("-frozen"):
        cfg.experimental_config.frozen_parameter = True
    if name == PIECEWISE:  # attention between captured pieces, as a server with paged attention runs it
        cfg.capture_config.mode = "piecewise"
        cfg.capture_config.split_ops = [SPLIT_ATTENTION]
        cfg.inference_config.input_gears = {"input_ids": {0: [1, 2, 4, 8]}, "position_ids": {0: [1, 2, 4, 8]}}
    return torch.compile(model, backend=graphgear.get_backend(cfg))


class Decoder:
    """One contender at one batch size: its model copy, compiled forward and cache."""

    def __init__(self, name: str, base: torch.nn.Module, batch: int) -> None:
        from transformers import StaticCache

        self.model = copy.deepcopy(base)
        self.fn = compiled(name, self.model)
        self.cache = StaticCache(config=self.model.config, max_cache_len=MAX_LEN)
        self.batch = batch
        self.tok = torch.randint(3, 100, (batch, 1), generator=torch.Generator().manual_seed(batch))
        self.pos = 0

    def step(self) -> torch.Tensor:
        if self.pos == MAX_LEN:
            self.cache.reset()
            self.pos = 0
        out = self.fn(input_ids=self.tok, cache=self.cache, use_cache=True,
                      position_ids=torch.full((self.batch, 1), self.pos))
        self.pos += 1
        return out.logits

    def run(self, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            self.step()
        return (time.perf_counter() - t0) / steps


def bench_size(size: str, batches: list[int], steps: int, rounds: int, contenders: list[str],
               dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    base = build(size, dtype)
    base32 = build(size) if dtype != torch.float32 else None
    res: dict[str, dict[int, float]] = {c: {} for c in contenders}
    diffs: dict[str, float] = {}
    diffs32: dict[str, float] = {}
    for batch in batches:
        graphgear.reset()
        torch._dynamo.reset()
        with torch.no_grad():
            decs = {c: Decoder(c, base, batch) for c in contenders}
            for c, d in decs.items():  # compile, warm up, capture
                t0 = time.perf_counter()
                for _ in range(3):
                    d.step()
                print(f"  {size} batch {batch} {c}: first steps {time.perf_counter() - t0:.1f} s",
                      file=sys.stderr, flush=True)
            # numerics: one fresh step each from the same cache state
            ref = None
            ref32 = Decoder("eager", base32, batch).step() if base32 is not None else None
            for c, d in decs.items():
                d.cache.reset()
                d.pos = 0
                out = d.step().clone()
                ref = out if ref is None else ref
                diffs[c] = max(diffs.get(c, 0.0), float((out.float() - ref.float()).abs().max()))
                if ref32 is not None:
                    diffs32[c] = max(diffs32.get(c, 0.0), float((out.float() - ref32).abs().max()))
            samples: dict[str, list[float]] = {c: [] for c in contenders}
            for r in range(rounds):
                order = contenders[r % len(contenders):] + contenders[: r % len(contenders)]
                for c in order:
                    samples[c].append(decs[c].run(steps))
        for c in contenders:
            res[c][batch] = statistics.median(samples[c])
    return {"size": size, "dtype": str(dtype).removeprefix("torch."), "itemsize": base.dtype.itemsize,
            "weight_bytes": weight_bytes(base), "us": res, "max_abs_diff": diffs, "max_abs_diff_float32": diffs32}


def scaling(size: str, contender: str, batches: list[int], steps: int, rounds: int,
            dtype: torch.dtype = torch.float32) -> dict[int, float]:
    """One contender's step at every batch size with the batches *interleaved* round by
    round (the table measures one batch size after another, so a slow spell of the
    machine lands on some batches only); seconds per step, median over rounds."""
    base = build(size, dtype)
    graphgear.reset()
    torch._dynamo.reset()
    samples: dict[int, list[float]] = {b: [] for b in batches}
    with torch.no_grad():
        decs = {b: Decoder(contender, base, b) for b in batches}
        for d in decs.values():
            for _ in range(3):
                d.step()
        for r in range(rounds):
            order = batches[r % len(batches):] + batches[: r % len(batches)]
            for b in order:
                decs[b].cache.reset()
                decs[b].pos = 0
                samples[b].append(decs[b].run(steps))
    med = {b: statistics.median(v) for b, v in samples.items()}
    print(f"\n{size}, {contender}, batches interleaved: " + ", ".join(
        f"batch {b} {med[b] * 1e6:.0f} us" for b in batches)
        + f"; step time batch {batches[-1]} / batch {batches[0]} = {med[batches[-1]] / med[batches[0]]:.2f}x "
        "(lower is better; target <= 1.5x)")
    return med


def print_table(r: dict[str, Any], batches: list[int], bw: float, peak: float) -> None:
    eager = r["us"]["eager"]
    print(f"\n{r['size']} ({r['dtype']}): weights {r['weight_bytes'] / 1e6:.1f} MB; machine read bandwidth "
          f"{bw:.1f} GB/s, {r['dtype']} GEMM {peak:.1f} GFLOP/s")
    print(f"each cell: us per step, {speedup_label('eager')}")
    head = f"{'contender':34s}" + "".join(f"{'batch ' + str(b):>20s}" for b in batches) + f"{'GB/s (batch 1)':>22s}"
    print(head)
    for c, per in r["us"].items():
        cells = "".join(f"{per[b] * 1e6:10.0f} us {eager[b] / per[b]:5.2f}x" for b in batches)
        b1 = batches[0]
        gbs = r["weight_bytes"] / per[b1] / 1e9
        print(f"{c:34s}{cells}{gbs:10.1f} ({100 * gbs / bw:3.0f} %)")
    floors = {b: floor_us(r["weight_bytes"], b, bw, peak, r["itemsize"]) for b in batches}
    print(f"{'roofline floor':34s}" + "".join(f"{us:10.0f} us {bound[:4]:>6s}" for us, bound in floors.values()))
    r["floor_us"] = {b: us for b, (us, _) in floors.items()}
    if "torch.compile" in r["us"]:
        tc = r["us"]["torch.compile"]
        for c in r["us"]:
            if c.startswith("graphgear"):
                print(f"  {c}: {speedup_label('torch.compile')} " + ", ".join(
                    f"batch {b} {tc[b] / r['us'][c][b]:.2f}x" for b in batches)
                    + f"; step time batch {batches[-1]} / batch {batches[0]} (lower is better) "
                    f"{r['us'][c][batches[-1]] / r['us'][c][batches[0]]:.2f}x; roofline floor / time "
                    "(higher is better): "
                    + ", ".join(f"{100 * floors[b][0] / (r['us'][c][b] * 1e6):.0f} %" for b in batches))
    print("  max abs diff of the logits vs eager: "
          + ", ".join(f"{c} {d:.1e}" for c, d in r["max_abs_diff"].items()))
    if r["max_abs_diff_float32"]:
        print(f"  max abs diff of the logits vs float32 eager (the {r['dtype']} rounding itself): "
              + ", ".join(f"{c} {d:.1e}" for c, d in r["max_abs_diff_float32"].items()))


def overhead(size: str, steps: int, rounds: int) -> dict[str, float]:
    """Where a served batch-1 step goes: the whole step, the CPU graph's replay alone
    (the generated kernels running on the recorded memory) and a bare compiled function
    (dynamo's floor), side by side; microseconds, median over rounds."""
    import gc

    from graphgear.capture import CaptureEngine

    graphgear.reset()
    dec = Decoder(SERVE, build(size), 1)
    bare = torch.compile(lambda x: x, backend=graphgear.get_backend())
    # the model's own Python and dynamo's frame and guards, with no kernels and no
    # AOTAutograd: a backend whose graph returns the outputs of its first run
    shell = Decoder("eager", dec.model, 1)
    shell.fn = torch.compile(shell.model, backend=_first_outputs, isolate_recompiles=True,
                             options={"guard_filter_fn": graphgear.inference.serving_guard_filter})
    x = torch.randn(4)
    with torch.no_grad():
        for _ in range(4):
            dec.step()
            shell.step()
            bare(x)
        engines = [o for o in gc.get_objects() if type(o) is CaptureEngine
                   and any(e.graph is not None for e in o.entries.values())]
        graph = next(e.graph for e in max(engines, key=lambda e: e.calls).entries.values()
                     if e.graph is not None)
        # the same served model, every call through dynamo (made after the graph above
        # was found: its replay writes dec's cache)
        via = Decoder(SERVE_VIA_DYNAMO, dec.model, 1)
        for _ in range(4):
            via.step()
        n = min(steps, MAX_LEN - 4)

        def timed(fn: Callable[[], Any], d: Decoder = dec) -> float:
            d.cache.reset()
            d.pos = 0
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            return (time.perf_counter() - t0) / n * 1e6

        parts: dict[str, list[float]] = {"step": [], "kernels": [], "bare": [], "shell": [], "via_dynamo": []}
        for _ in range(rounds):
            parts["step"].append(timed(dec.step))
            parts["via_dynamo"].append(timed(via.step, via))
            parts["kernels"].append(timed(graph.replay))
            parts["bare"].append(timed(lambda: bare(x)))
            parts["shell"].append(timed(shell.step))
    med = {k: statistics.median(v) for k, v in parts.items()}
    floor = med["kernels"] + med["bare"]
    print(f"\n{size}, served batch-1 step: {med['step']:.0f} us; kernels (replay alone) "
          f"{med['kernels']:.0f} us + bare compiled call {med['bare']:.1f} us = {floor:.0f} us; "
          f"step / that = {med['step'] / floor:.2f}x (lower is better; target <= 1.5x)")
    print(f"  the same served model with every call through dynamo's frame evaluation "
          f"(serve(direct=False)): {med['via_dynamo']:.0f} us; direct serving's {speedup_label('that')}: "
          f"{med['via_dynamo'] / med['step']:.2f}x")
    rest = med["step"] - med["kernels"] - med["shell"]
    print(f"  the model's Python and dynamo's frame and guards alone (a backend returning stored "
          f"outputs): {med['shell']:.0f} us; so AOTAutograd's wrapper and graphgear's engine take "
          f"{rest:.0f} us of the step; (kernels + that shell) / step = "
          f"{(med['kernels'] + med['shell']) / med['step']:.2f}")
    with torch.no_grad():
        situ = _in_situ(dec, n, rounds)
    print(f"  timed where they run (the kernels evict the caches, so everything in a step runs "
          f"slower than in a hot loop): step {situ['step']:.0f} us = CPU graph replay "
          f"{situ['replay']:.0f} + the rest of graphgear's engine {situ['engine'] - situ['replay']:.0f} "
          f"+ AOTAutograd, dynamo and the model's Python {situ['step'] - situ['engine']:.0f}")
    med.update({f"in_situ_{k}": v for k, v in situ.items()})
    return med


def _in_situ(dec: Decoder, n: int, rounds: int) -> dict[str, float]:
    """The served step with graphgear's engine call and CPU graph replay timed inside
    it (their classes' methods wrapped for the measurement, restored after); median
    round, microseconds per step."""
    from graphgear.capture import CaptureEngine
    from graphgear.capture.cpu_graph import CPUGraph

    acc = {"engine": 0.0, "replay": 0.0}
    saved = [(CaptureEngine, "__call__", "engine"), (CPUGraph, "replay", "replay")]
    origs = [getattr(cls, name) for cls, name, _ in saved]

    def timing(orig: Callable[..., Any], key: str) -> Callable[..., Any]:
        def run(self: Any, *a: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(self, *a)
            finally:
                acc[key] += time.perf_counter() - t0
        return run

    rows = []
    try:
        for (cls, name, key), orig in zip(saved, origs):
            setattr(cls, name, timing(orig, key))
        for _ in range(rounds):
            dec.cache.reset()
            dec.pos = 0
            acc.update(engine=0.0, replay=0.0)
            t0 = time.perf_counter()
            for _ in range(n):
                dec.step()
            rows.append(((time.perf_counter() - t0) / n, acc["engine"] / n, acc["replay"] / n))
    finally:
        for (cls, name, _), orig in zip(saved, origs):
            setattr(cls, name, orig)
    step, engine, replay = sorted(rows)[len(rows) // 2]
    return {"step": step * 1e6, "engine": engine * 1e6, "replay": replay * 1e6}


def _first_outputs(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """A dynamo backend that runs the graph once and then returns those outputs again:
    what a step costs with no kernels at all (its numbers are stale on purpose)."""
    memo: list[Any] = []

    def run(*args: Any) -> Any:
        if not memo:
            memo.append(gm(*args))
        return memo[0]

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="*", type=name_type(tuple(SIZES), "model size"), default=["small"],
                    help="space-separated: tiny, small, large (none: --sizes alone)")
    ap.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 2, 4, 8], help="space-separated")
    ap.add_argument("--steps", type=int, default=50, help="steps per contender per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--contenders", nargs="+", type=name_type(CONTENDERS), default=list(CONTENDERS),
                    help=f"space-separated, out of: {', '.join(CONTENDERS)}; eager is always run (the "
                         "reference of speedups and numerics)")
    ap.add_argument("--scaling", default=SERVE, type=name_type(("none", *CONTENDERS)),
                    help="contender whose batches are then timed interleaved (none: none)")
    ap.add_argument("--overhead", default="tiny", type=name_type(("none", *SIZES), "model size"),
                    help="model size for the overhead split (none: none)")
    ap.add_argument("--json", help="write the results here, with the run's versions, threads, CPU and commit")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                    help="the models' parameter dtype (the overhead split stays float32)")
    a = ap.parse_args(argv)
    dtype = DTYPES[a.dtype]
    torch.set_num_threads(a.threads)
    contenders = list(dict.fromkeys(a.contenders))
    a.scaling = None if a.scaling == "none" else a.scaling
    a.overhead = None if a.overhead == "none" else a.overhead
    if "eager" not in contenders:  # the reference of every ratio and of the numerics
        contenders.insert(0, "eager")
    contenders.sort(key=lambda c: c != "eager")
    bw = read_bandwidth()
    peak = gemm_peak(dtype)
    sizes = list(dict.fromkeys(a.sizes))
    results = []
    for size in sizes:
        r = bench_size(size, a.batch_sizes, a.steps, a.rounds, contenders, dtype)
        print_table(r, a.batch_sizes, bw, peak)
        results.append(r)
    scaled = {size: scaling(size, a.scaling, a.batch_sizes, a.steps, a.rounds, dtype)
              for size in sizes} if a.scaling and len(a.batch_sizes) > 1 else None
    split = overhead(a.overhead, a.steps, a.rounds) if a.overhead else None
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": {**run_metadata(), "command": " ".join(sys.argv)}, "read_bandwidth_gbs": bw, "gemm_gflops": peak, "threads": a.threads, "results": results,
                       "overhead": split, "scaling": scaled}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``graphgear bench``: decode steps of a model in eager, ``torch.compile`` default and
each graphgear mode, side by side in one process.

Each contender gets its own copy of the model (same weights, fresh KV cache) and the
same token stream; its logits are compared with eager's at every step. Times are per
step, measured after warm-up, on the host clock (with a device sync on accelerators).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm import tqdm

from ..backend import get_backend
from ..config import CompilerConfig
from ..debug import text_table
from ..dispatch import precompile_gears
from ..gears import set_dim_gears
from ..stats import reset, stats
from .toy_decoder import DecoderConfig, ToyDecoder

log = logging.getLogger(__name__)

__all__ = ["BenchResult", "format_table", "run_bench"]

CONTENDERS = ("eager", "torch.compile", "graphgear max-autotune", "graphgear reduce-overhead")


@dataclasses.dataclass
class BenchResult:
    mode: str
    batch_size: int
    compile_seconds: float = 0.0
    median_us: float = float("nan")
    p90_us: float = float("nan")
    speedup: float = float("nan")
    vs_torch_compile: float = float("nan")  # time ratio to torch.compile's default
    max_abs_diff: float = float("nan")
    graphs: int = 0
    error: str = ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "npu":  # pragma: no cover - needs torch_npu
        torch.npu.synchronize()  # type: ignore[attr-defined]


def _compile(name: str, model: torch.nn.Module) -> Callable[..., Any]:
    if name == "eager":
        return model
    if name == "torch.compile":
        return torch.compile(model)
    cfg = CompilerConfig()
    cfg.mode = name.split()[-1]
    return torch.compile(model, backend=get_backend(compiler_config=cfg))


def _positions(steps: int, max_len: int) -> list[int]:
    return [s % max_len for s in range(steps)]


def run_bench(
    *,
    device: str = "cpu",
    batch_sizes: Sequence[int] = (1,),
    steps: int = 200,
    warmup: int = 10,
    rounds: int = 5,
    contenders: Sequence[str] = CONTENDERS,
    decoder_config: DecoderConfig | None = None,
    progress: bool = True,
    seed: int = 0,
) -> list[BenchResult]:
    """Run the bench; returns one result per contender and batch size.

    Every contender is compiled first (for several batch sizes, graphgear builds every
    gear up front). Then, per batch size, the timed steps run in ``rounds`` interleaved
    chunks, the contenders' order rotating each round, so that a noisy neighbour slows
    every contender alike instead of whichever ran at the time.
    """
    dev = torch.device(device)
    cfg = decoder_config or DecoderConfig(max_batch_size=max(max(batch_sizes), 1))
    if max(batch_sizes) > cfg.max_batch_size:
        raise ValueError(
            f"graphgear bench: batch size {max(batch_sizes)} is above the decoder's "
            f"max_batch_size {cfg.max_batch_size}; pass smaller --batch-sizes."
        )
    torch.manual_seed(seed)
    base = ToyDecoder(cfg).eval().to(dev)
    gen = torch.Generator().manual_seed(seed + 1)
    n = warmup + steps
    streams = {
        b: [torch.randint(0, cfg.vocab_size, (b, 1), generator=gen).to(dev) for _ in range(n)]
        for b in batch_sizes
    }
    positions = [torch.tensor([p], device=dev) for p in _positions(n, cfg.max_seq_len)]
    geared = len(batch_sizes) > 1
    bar = None
    if progress:
        bar = tqdm(total=len(contenders) * len(batch_sizes) * n, desc="graphgear bench",
                   unit="step", leave=False)

    def tokens(name: str, b: int, i: int) -> torch.Tensor:
        tok = streams[b][i]
        if geared and name.startswith("graphgear"):
            tok = tok.clone()
            set_dim_gears(tok, {0: sorted(batch_sizes)})
        return tok

    reset()
    runners: dict[str, tuple[torch.nn.Module, Callable[..., Any]]] = {}
    results: dict[tuple[str, int], BenchResult] = {}
    for name in contenders:
        model = copy.deepcopy(base)
        before = len(stats().graphs)
        if bar is not None:
            bar.set_description(f"compiling {name}")
        try:
            t0 = time.perf_counter()
            fn = _compile(name, model)
            if name != "eager":
                with torch.no_grad():
                    if geared and name.startswith("graphgear"):
                        precompile_gears(fn, tokens(name, batch_sizes[0], 0), positions[0], progress=progress)
                    # two calls per size: reduce-overhead warms up on the first and
                    # captures on the second; compile seconds include both
                    for b in batch_sizes:
                        for _ in range(2):
                            fn(tokens(name, b, 0), positions[0])
                _sync(dev)
            seconds = time.perf_counter() - t0
        except Exception as e:  # report it and go on with the next contender
            log.warning("graphgear bench: %s failed to compile: %s", name, e)
            for b in batch_sizes:
                results[(name, b)] = BenchResult(name, b, error=f"{type(e).__name__}: {e}"[:200])
            if bar is not None:
                bar.update(len(batch_sizes) * n)
            continue
        graphs = sum(g.compiles for g in stats().graphs[before:])
        runners[name] = (model, fn)
        for b in batch_sizes:
            results[(name, b)] = BenchResult(name, b, compile_seconds=seconds, graphs=graphs)

    chunks = _chunks(warmup, n, rounds)
    for b in batch_sizes:
        times: dict[str, list[float]] = {name: [] for name in runners}
        outs: dict[str, list[torch.Tensor]] = {name: [] for name in runners}
        for model, _ in runners.values():
            model.reset_cache()
        for r, (lo, hi) in enumerate(chunks):
            order = list(runners)
            order = order[r % len(order):] + order[: r % len(order)] if order else order
            for name in order:
                res = results[(name, b)]
                if res.error:
                    continue
                if bar is not None:
                    bar.set_description(f"{name} batch {b}")
                _, fn = runners[name]
                try:
                    with torch.no_grad():
                        for i in range(lo, hi):
                            tok = tokens(name, b, i)
                            _sync(dev)
                            t = time.perf_counter()
                            out = fn(tok, positions[i])
                            _sync(dev)
                            dt = time.perf_counter() - t
                            outs[name].append(out.detach().float().cpu().clone())
                            if i >= warmup:
                                times[name].append(dt)
                except Exception as e:
                    log.warning("graphgear bench: %s batch %d failed: %s", name, b, e)
                    res.error = f"{type(e).__name__}: {e}"[:200]
                if bar is not None:
                    bar.update(hi - lo)
        ref = outs.get("eager")
        for name in runners:
            res = results[(name, b)]
            if res.error or not times[name]:
                continue
            ts = times[name]
            res.median_us = statistics.median(ts) * 1e6
            res.p90_us = statistics.quantiles(ts, n=10)[-1] * 1e6 if len(ts) >= 2 else res.median_us
            if ref is not None and len(ref) == len(outs[name]):
                res.max_abs_diff = max(float((o - e).abs().max()) for o, e in zip(outs[name], ref))
    if bar is not None:
        bar.close()
    ordered = [results[(name, b)] for name in contenders for b in batch_sizes]
    eager_us = {r.batch_size: r.median_us for r in ordered if r.mode == "eager" and not r.error}
    tc_us = {r.batch_size: r.median_us for r in ordered if r.mode == "torch.compile" and not r.error}
    for r in ordered:
        if r.batch_size in eager_us and not r.error:
            r.speedup = eager_us[r.batch_size] / r.median_us
        if r.batch_size in tc_us and not r.error:
            r.vs_torch_compile = r.median_us / tc_us[r.batch_size]
    return ordered


def _chunks(warmup: int, n: int, rounds: int) -> list[tuple[int, int]]:
    """Step ranges: the warm-up steps first, then the timed steps in ``rounds`` parts."""
    out = [(0, warmup)] if warmup else []
    timed = n - warmup
    rounds = max(1, min(rounds, timed))
    edges = [warmup + timed * k // rounds for k in range(rounds + 1)]
    out += [(lo, hi) for lo, hi in zip(edges, edges[1:]) if hi > lo]
    return out


def format_table(results: Sequence[BenchResult]) -> str:
    """The results as an aligned text table."""
    cols = ["mode", "batch", "compile s", "median us", "p90 us", "speedup", "time vs torch.compile",
            "max abs diff"]
    rows = []
    for r in results:
        if r.error:
            rows.append([r.mode, str(r.batch_size), "-", "-", "-", "-", "-", f"failed: {r.error}"])
            continue
        rows.append([
            r.mode, str(r.batch_size), f"{r.compile_seconds:.1f}", f"{r.median_us:.0f}",
            f"{r.p90_us:.0f}", f"{r.speedup:.2f}x",
            "-" if r.vs_torch_compile != r.vs_torch_compile else f"{r.vs_torch_compile:.2f}x",
            f"{r.max_abs_diff:.2e}",
        ])
    return text_table(cols, rows)


def write_json(results: Sequence[BenchResult], path: str, meta: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": [dataclasses.asdict(r) for r in results]}, f, indent=2)


def plot(results: Sequence[BenchResult], path: str, *, title: str = "graphgear bench") -> None:
    """Step time against batch size, one line per contender, written to ``path`` (PNG).
    Needs matplotlib (``pip install 'graphgear[plot]'``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in dict.fromkeys(r.mode for r in results):
        pts = sorted((r.batch_size, r.median_us) for r in results if r.mode == mode and not r.error)
        if pts:
            ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", label=mode)
    ax.set_xlabel("batch size")
    ax.set_ylabel("µs per decode step (median)")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

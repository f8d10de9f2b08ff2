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
    max_abs_diff: float = float("nan")
    graphs: int = 0
    error: str = ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "npu":  # pragma: no cover - needs torch_npu
        torch.npu.synchronize()  # type: ignore[attr-defined]


def _compile(name: str, model: torch.nn.Module) -> Callable[..., Any]:
    import graphgear

    if name == "eager":
        return model
    if name == "torch.compile":
        return torch.compile(model)
    cfg = graphgear.CompilerConfig()
    cfg.mode = name.split()[-1]
    return torch.compile(model, backend=graphgear.get_backend(compiler_config=cfg))


def _positions(steps: int, max_len: int) -> list[int]:
    return [s % max_len for s in range(steps)]


def run_bench(
    *,
    device: str = "cpu",
    batch_sizes: Sequence[int] = (1,),
    steps: int = 200,
    warmup: int = 10,
    contenders: Sequence[str] = CONTENDERS,
    decoder_config: DecoderConfig | None = None,
    progress: bool = True,
    seed: int = 0,
) -> list[BenchResult]:
    """Run the bench; returns one result per contender and batch size."""
    import graphgear
    from graphgear.gears import precompile_gears

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
    streams = {
        b: [torch.randint(0, cfg.vocab_size, (b, 1), generator=gen).to(dev) for _ in range(warmup + steps)]
        for b in batch_sizes
    }
    positions = [torch.tensor([p], device=dev) for p in _positions(warmup + steps, cfg.max_seq_len)]
    geared = len(batch_sizes) > 1
    total = len(contenders) * len(batch_sizes) * (warmup + steps)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="graphgear bench", unit="step", leave=False)
    reference: dict[int, list[torch.Tensor]] = {}
    results: list[BenchResult] = []
    for name in contenders:
        graphgear.reset()
        model = copy.deepcopy(base)
        compile_seconds = 0.0
        try:
            t0 = time.perf_counter()
            fn = _compile(name, model)
            if name != "eager":
                if bar is not None:
                    bar.set_description(f"compiling {name}")
                first = streams[batch_sizes[0]][0].clone()
                if geared and name.startswith("graphgear"):
                    graphgear.set_dim_gears(first, {0: sorted(batch_sizes)})
                with torch.no_grad():
                    if geared and name.startswith("graphgear"):
                        precompile_gears(fn, first, positions[0], progress=progress)
                    else:
                        # two calls: reduce-overhead warms up on the first, captures on
                        # the second; compile seconds include both
                        for b in batch_sizes:
                            for _ in range(2):
                                fn(streams[b][0], positions[0])
                _sync(dev)
                model.reset_cache()
            compile_seconds = time.perf_counter() - t0
        except Exception as e:  # report and go on with the next contender
            log.warning("graphgear bench: %s failed to compile: %s", name, e)
            for b in batch_sizes:
                results.append(BenchResult(name, b, error=f"{type(e).__name__}: {e}"[:200]))
            if bar is not None:
                bar.update(len(batch_sizes) * (warmup + steps))
            continue
        for b in batch_sizes:
            if bar is not None:
                bar.set_description(f"{name} batch {b}")
            res = BenchResult(name, b, compile_seconds=compile_seconds)
            model.reset_cache()
            times: list[float] = []
            outs: list[torch.Tensor] = []
            try:
                with torch.no_grad():
                    for i, (tok, pos) in enumerate(zip(streams[b], positions)):
                        if geared and name.startswith("graphgear"):
                            tok = tok.clone()
                            graphgear.set_dim_gears(tok, {0: sorted(batch_sizes)})
                        _sync(dev)
                        t = time.perf_counter()
                        out = fn(tok, pos)
                        _sync(dev)
                        dt = time.perf_counter() - t
                        outs.append(out.detach().float().cpu().clone())
                        if i >= warmup:
                            times.append(dt)
                        if bar is not None:
                            bar.update(1)
            except Exception as e:
                log.warning("graphgear bench: %s batch %d failed: %s", name, b, e)
                res.error = f"{type(e).__name__}: {e}"[:200]
                results.append(res)
                continue
            res.median_us = statistics.median(times) * 1e6
            res.p90_us = statistics.quantiles(times, n=10)[-1] * 1e6 if len(times) >= 2 else res.median_us
            if name == "eager":
                reference[b] = outs
            ref = reference.get(b)
            if ref is not None:
                res.max_abs_diff = max(float((o - r).abs().max()) for o, r in zip(outs, ref))
            if name.startswith("graphgear"):
                res.graphs = sum(g.compiles for g in graphgear.stats().graphs)
            results.append(res)
    if bar is not None:
        bar.close()
    eager_us = {r.batch_size: r.median_us for r in results if r.mode == "eager"}
    for r in results:
        if r.batch_size in eager_us and r.median_us == r.median_us:
            r.speedup = eager_us[r.batch_size] / r.median_us
    return results


def format_table(results: Sequence[BenchResult]) -> str:
    """The results as an aligned text table."""
    cols = ["mode", "batch", "compile s", "median us", "p90 us", "speedup", "max abs diff"]
    rows = []
    for r in results:
        if r.error:
            rows.append([r.mode, str(r.batch_size), "-", "-", "-", "-", f"failed: {r.error}"])
            continue
        rows.append([
            r.mode, str(r.batch_size), f"{r.compile_seconds:.1f}", f"{r.median_us:.0f}",
            f"{r.p90_us:.0f}", f"{r.speedup:.2f}x", f"{r.max_abs_diff:.2e}",
        ])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def write_json(results: Sequence[BenchResult], path: str, meta: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": [dataclasses.asdict(r) for r in results]}, f, indent=2)

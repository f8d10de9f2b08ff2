"""``graphgear bench``: decode steps of a model in eager, ``torch.compile`` default and
each graphgear mode, side by side in one process.

Each contender gets its own copy of the model (same weights, fresh KV cache) and the
same token stream; its logits are compared with eager's at every step. Times are per
step, measured after warm-up, on the host clock (with a device sync on accelerators).
Contenders are named as in :mod:`graphgear.bench.names`; ratios are speedups (a
reference's step time over the contender's: higher is better).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm import tqdm

from ..backend import get_backend
from ..config import CompilerConfig
from ..dispatch import precompile_gears
from ..gears import set_dim_gears
from ..inference import serve
from ..stats import reset, stats
from .models import BenchModel, build_model
from .names import CONTENDERS, EAGER, MAX_AUTOTUNE, REDUCE_OVERHEAD, SERVE, TORCH_COMPILE, check_name

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_CONTENDERS", "BenchResult", "run_bench"]

#: what ``graphgear bench`` runs unless told otherwise
DEFAULT_CONTENDERS = CONTENDERS


@dataclasses.dataclass
class BenchResult:
    """One contender at one batch size. Speedups are a reference's median step time over
    this one's (higher is better); NaN where the reference did not run."""

    contender: str
    batch_size: int
    compile_seconds: float = 0.0
    median_us: float = float("nan")
    p90_us: float = float("nan")
    speedup_vs_eager: float = float("nan")
    speedup_vs_torch_compile: float = float("nan")
    max_abs_diff: float = float("nan")
    graphs: int = 0
    error: str = ""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    elif device.type == "npu":  # pragma: no cover - needs torch_npu
        torch.npu.synchronize()  # type: ignore[attr-defined]


def _compile(name: str, model: torch.nn.Module) -> Callable[..., Any]:
    if name == EAGER:
        return model
    if name == TORCH_COMPILE:
        return torch.compile(model)
    if name == SERVE:
        return serve(model)
    cfg = CompilerConfig()
    cfg.mode = {MAX_AUTOTUNE: "max-autotune", REDUCE_OVERHEAD: "reduce-overhead"}[name]
    return torch.compile(model, backend=get_backend(compiler_config=cfg))


def _graphgear(name: str) -> bool:
    return name.startswith("graphgear")


def _chunks(warmup: int, n: int, rounds: int) -> list[tuple[int, int]]:
    """Step ranges: the warm-up steps first, then the timed steps in ``rounds`` parts."""
    out = [(0, warmup)] if warmup else []
    timed = n - warmup
    rounds = max(1, min(rounds, timed))
    edges = [warmup + timed * k // rounds for k in range(rounds + 1)]
    out += [(lo, hi) for lo, hi in zip(edges, edges[1:]) if hi > lo]
    return out


class _Run:
    """The state of one bench: the token streams, the positions, the progress bar."""

    def __init__(self, spec: BenchModel, dev: torch.device, batch_sizes: Sequence[int], n: int,
                 contenders: Sequence[str], seed: int, progress: bool) -> None:
        self.spec, self.dev, self.n = spec, dev, n
        gen = torch.Generator().manual_seed(seed + 1)
        self.streams = {b: [torch.randint(0, spec.vocab_size, (b, 1), generator=gen).to(dev) for _ in range(n)]
                        for b in batch_sizes}
        self.positions = [torch.tensor([i % spec.max_seq_len], device=dev) for i in range(n)]
        # steps where the positions wrap to 0: the cache starts over (before the step, untimed)
        self.wraps = {i for i in range(1, n) if i % spec.max_seq_len == 0}
        self.bar = (tqdm(total=len(contenders) * len(batch_sizes) * n, desc="graphgear bench", unit="step",
                         leave=False) if progress else None)
        self.progress = progress

    def tokens(self, name: str, b: int, i: int, gears: Sequence[int]) -> torch.Tensor:
        tok = self.streams[b][i]
        if len(gears) > 1 and _graphgear(name):
            tok = tok.clone()
            set_dim_gears(tok, {0: sorted(gears)})
        return tok

    def note(self, text: str, steps: int = 0) -> None:
        if self.bar is not None:
            if text:
                self.bar.set_description(text)
            self.bar.update(steps)

    def compile(self, name: str, phase: Sequence[int], results: dict[tuple[str, int], BenchResult]
                ) -> tuple[torch.nn.Module, Callable[..., Any]] | None:
        """``name`` compiled on a fresh model copy for the batch sizes of ``phase``, each
        size called twice (reduce-overhead warms up, then captures); None when it fails
        (the results say why)."""
        self.note(f"compiling {name}")
        before = len(stats().graphs)
        p0 = self.positions[0]
        try:
            t0 = time.perf_counter()
            model = self.spec.make(max(phase))
            fn = _compile(name, model)
            if name != EAGER:
                with torch.no_grad():
                    if len(phase) > 1 and _graphgear(name):
                        precompile_gears(fn, self.tokens(name, phase[0], 0, phase), p0, progress=self.progress)
                    for b in phase:
                        for _ in range(2):
                            fn(self.tokens(name, b, 0, phase), p0)
                _sync(self.dev)
            seconds = time.perf_counter() - t0
        except Exception as e:  # say so in the table and go on with the next contender
            log.warning("graphgear bench: %s failed to compile: %s", name, e)
            for b in phase:
                results[(name, b)] = BenchResult(name, b, error=f"{type(e).__name__}: {e}"[:200])
            self.note("", len(phase) * self.n)
            return None
        graphs = sum(g.compiles for g in stats().graphs[before:])
        for b in phase:
            results[(name, b)] = BenchResult(name, b, compile_seconds=seconds, graphs=graphs)
        return model, fn

    def time_batch(self, b: int, phase: Sequence[int], runners: dict[str, tuple[torch.nn.Module, Any]],
                   results: dict[tuple[str, int], BenchResult], warmup: int, rounds: int) -> None:
        """Every runner at batch ``b``: the steps in interleaved rounds, the contenders'
        order rotating each round; then the medians and the difference from eager."""
        times: dict[str, list[float]] = {name: [] for name in runners}
        outs: dict[str, list[torch.Tensor]] = {name: [] for name in runners}
        for model, _ in runners.values():
            model.reset_cache()
        for r, (lo, hi) in enumerate(_chunks(warmup, self.n, rounds)):
            order = list(runners)
            order = order[r % len(order):] + order[: r % len(order)] if order else order
            for name in order:
                res = results[(name, b)]
                if res.error:
                    continue
                self.note(f"{name} batch {b}")
                model, fn = runners[name]
                try:
                    with torch.no_grad():
                        for i in range(lo, hi):
                            if i in self.wraps:
                                model.reset_cache()  # positions wrapped: start the cache over
                            tok = self.tokens(name, b, i, phase)
                            _sync(self.dev)
                            t = time.perf_counter()
                            out = fn(tok, self.positions[i])
                            _sync(self.dev)
                            dt = time.perf_counter() - t
                            outs[name].append(out.detach().float().cpu().clone())
                            if i >= warmup:
                                times[name].append(dt)
                except Exception as e:
                    log.warning("graphgear bench: %s batch %d failed: %s", name, b, e)
                    res.error = f"{type(e).__name__}: {e}"[:200]
                self.note("", hi - lo)
        ref = outs.get(EAGER)
        for name in runners:
            res = results[(name, b)]
            if res.error or not times[name]:
                continue
            ts = times[name]
            res.median_us = statistics.median(ts) * 1e6
            res.p90_us = statistics.quantiles(ts, n=10)[-1] * 1e6 if len(ts) >= 2 else res.median_us
            if ref is not None and len(ref) == len(outs[name]):
                res.max_abs_diff = max(float((o - e).abs().max()) for o, e in zip(outs[name], ref))


def run_bench(
    *,
    model: str = "toy",
    dtype: str = "float32",
    device: str = "cpu",
    batch_sizes: Sequence[int] = (1,),
    steps: int = 200,
    warmup: int = 10,
    rounds: int = 5,
    contenders: Sequence[str] = DEFAULT_CONTENDERS,
    progress: bool = True,
    seed: int = 0,
) -> list[BenchResult]:
    """Run the bench; returns one result per contender and batch size, in the order of
    ``contenders`` (each one of :data:`~graphgear.bench.names.CONTENDERS`).

    ``model``: ``toy`` (one model for every batch size: graphgear builds every gear up
    front when there are several) or a transformers architecture (one model copy and
    compile per batch size; dynamo is reset between batch sizes). The timed steps run in
    ``rounds`` interleaved chunks, the contenders' order rotating each round, so that a
    noisy neighbour slows every contender alike instead of whichever ran at the time.
    """
    for name in contenders:
        check_name(name, CONTENDERS)
    sizes = list(dict.fromkeys(batch_sizes))
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"graphgear bench: batch sizes must be positive ints, got {list(batch_sizes)}")
    dev = torch.device(device)
    spec = build_model(model, dtype=dtype, device=device, max_batch_size=max(sizes), seed=seed)
    run = _Run(spec, dev, sizes, warmup + steps, contenders, seed, progress)
    phases = [[b] for b in sizes] if spec.per_batch else [sizes]
    reset()
    results: dict[tuple[str, int], BenchResult] = {}
    for k, phase in enumerate(phases):
        if k:
            torch.compiler.reset()  # a fresh compile per batch size: no recompile limit reached
        runners = {}
        for name in contenders:
            made = run.compile(name, phase, results)
            if made is not None:
                runners[name] = made
        for b in phase:
            run.time_batch(b, phase, runners, results, warmup, rounds)
        del runners
    if run.bar is not None:
        run.bar.close()
    ordered = [results[(name, b)] for name in contenders for b in sizes]
    eager_us = {r.batch_size: r.median_us for r in ordered if r.contender == EAGER and not r.error}
    tc_us = {r.batch_size: r.median_us for r in ordered if r.contender == TORCH_COMPILE and not r.error}
    for r in ordered:
        if r.error:
            continue
        if r.batch_size in eager_us:
            r.speedup_vs_eager = eager_us[r.batch_size] / r.median_us
        if r.batch_size in tc_us:
            r.speedup_vs_torch_compile = tc_us[r.batch_size] / r.median_us
    return ordered

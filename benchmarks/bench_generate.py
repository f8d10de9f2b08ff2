"""transformers ``generate()`` with a static cache: eager, Inductor and graphgear side by side.

    python benchmarks/bench_generate.py [--requests 100] [--batch-sizes 1 4] [--threads 1]
                                        [--new-tokens 16] [--prompt-len 8] [--json FILE]

A transformers Qwen2 (hidden 256, 4 layers, vocab 2048, random weights, built from a
config; nothing is downloaded) generates ``--new-tokens`` tokens per request with
``cache_implementation="static"``. Contenders, each its own copy of the same weights
(named as in every graphgear table, ``graphgear.bench.names``):

* ``eager``: no compile config;
* ``torch.compile``: ``CompileConfig(backend="inductor", mode="default")`` (its default);
* ``graphgear-reduce-overhead``: ``CompileConfig(backend="graphgear", mode=None,
  options={"mode": "reduce-overhead"})``;
* ``graphgear-max-autotune``: the same with ``options={"mode": "max-autotune"}``;
* ``graphgear-serve``: reduce-overhead with frozen weights and the serving guard filter.

On the CPU transformers compiles only with ``compile_config._compile_all_devices = True``
(set here). Requests are interleaved in rounds (every contender serves request ``r``
before any serves ``r + 1``; the order rotates each round) so machine noise hits all
alike. Printed per batch size: the median seconds per request over requests 2..N, ms per
new token, speedups vs eager and vs torch.compile (their time / the contender's: higher
is better), dynamo frame compiles after the first request (recompiles), graphgear's
captures, rebinds and uncaptured runs, and whether every request's tokens equal eager's.
RSS (``/proc/self/statm``) is printed after warm-up and at the end of each batch size.
Exits 1 when a target of issue 9 is missed (graphgear-reduce-overhead: speedup >= 2.0x
vs eager and >= 1.0x vs torch.compile; graphgear-max-autotune: >= 1.0x vs torch.compile)
or tokens differ.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from graphgear.cache.store import use_private_inductor_cache  # noqa: E402

use_private_inductor_cache()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import graphgear  # noqa: E402
from graphgear.bench.names import CONTENDERS, name_type, positive_int, speedup_label, speedup_note  # noqa: E402
from graphgear.env import run_metadata  # noqa: E402

EAGER, TORCH_COMPILE, MAX_AUTOTUNE, REDUCE_OVERHEAD, SERVE = CONTENDERS


def rss_mb() -> float:
    """Resident set size of this process in MB, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1])
    return resident * os.sysconf("SC_PAGE_SIZE") / 2**20


def build_model(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=2048, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval()


def compile_config(name: str) -> Any:
    """The ``CompileConfig`` of contender ``name`` (None for eager)."""
    from transformers import CompileConfig

    if name == EAGER:
        return None
    if name == TORCH_COMPILE:
        cc = CompileConfig(backend="inductor", mode="default")
    elif name == SERVE:  # reduce-overhead, frozen (packed) weights, serving guard filter
        cc = CompileConfig(backend="graphgear", mode=None, options={
            "mode": "reduce-overhead", "frozen_parameter": True,
            "guard_filter_fn": graphgear.inference.serving_guard_filter})
    else:
        mode = {REDUCE_OVERHEAD: "reduce-overhead", MAX_AUTOTUNE: "max-autotune"}[name]
        cc = CompileConfig(backend="graphgear", mode=None, options={"mode": mode})
    cc._compile_all_devices = True  # transformers compiles on CUDA only otherwise
    return cc


def frames_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def run_batch(batch: int, a: argparse.Namespace, contenders: list[str]) -> dict[str, Any]:
    graphgear.reset()
    base = build_model()
    models: dict[str, torch.nn.Module] = {}
    for name in contenders:
        m = build_model()
        m.load_state_dict(base.state_dict())
        models[name] = m
    gen = torch.Generator().manual_seed(1234 + batch)
    prompts = [torch.randint(2, 2048, (batch, a.prompt_len), generator=gen) for _ in range(a.requests)]
    kw = dict(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False,
              cache_implementation="static", pad_token_id=0)
    configs = {name: compile_config(name) for name in contenders}
    times: dict[str, list[float]] = {n: [] for n in contenders}
    frames: dict[str, int] = dict.fromkeys(contenders, 0)
    records: dict[str, set[str]] = {n: set() for n in contenders}
    first_s: dict[str, float] = {}
    mismatches: dict[str, int] = dict.fromkeys(contenders, 0)
    rss: dict[str, float] = {}
    order = list(contenders)
    with torch.no_grad():
        for r, ids in enumerate(prompts):
            if r == 1:
                rss["after_warmup"] = rss_mb()
            ref = None
            outs: dict[str, torch.Tensor] = {}
            for name in order:
                before = {g.name for g in graphgear.stats().graphs}
                f0 = frames_compiled()
                t0 = time.perf_counter()
                out = models[name].generate(ids, compile_config=configs[name], **kw)
                dt = time.perf_counter() - t0
                if r >= 1:
                    frames[name] += frames_compiled() - f0
                else:
                    first_s[name] = dt
                records[name] |= {g.name for g in graphgear.stats().graphs} - before
                times[name].append(dt)
                outs[name] = out
            ref = outs.get(EAGER)
            if ref is not None:
                for name, out in outs.items():
                    if not torch.equal(out, ref):
                        mismatches[name] += 1
            order = order[1:] + order[:1]
    rss["end"] = rss_mb()
    by_name = {g.name: g for g in graphgear.stats().graphs}
    result: dict[str, Any] = {"batch": batch, "rss_mb": rss, "contenders": {}}
    for name in contenders:
        steady = times[name][1:] or times[name]
        recs = [by_name[n] for n in sorted(records[name]) if n in by_name]
        result["contenders"][name] = {
            "first_request_s": first_s[name],
            "median_s": statistics.median(steady),
            "p90_s": sorted(steady)[int(0.9 * (len(steady) - 1))],
            "ms_per_token": statistics.median(steady) / a.new_tokens * 1e3,
            "recompiles": frames[name],
            "graphs": len(recs),
            "captures": sum(g.captures for g in recs),
            "rebinds": sum(g.rebinds for g in recs),
            "recaptures": sum(getattr(g, "recaptures", 0) for g in recs),
            "uncaptured_runs": sum(g.uncaptured_runs for g in recs),
            "fallbacks": sorted({op for g in recs for op, _ in g.fallbacks}),
            "mismatches": mismatches[name],
        }
    return result


def report(res: dict[str, Any], a: argparse.Namespace) -> list[str]:
    c = res["contenders"]
    batch = res["batch"]
    print(f"\nbatch {batch}: {a.requests} requests x {a.new_tokens} new tokens, prompt {a.prompt_len}, "
          f"{a.threads} thread(s); median over requests 2..N")
    se, stc = speedup_label(EAGER, direction=False), speedup_label(TORCH_COMPILE, direction=False)
    head = (f"{'contender':28s}{'1st req s':>10s}{'s/request':>11s}{'ms/token':>10s}{se:>18s}"
            f"{stc:>26s}{'recompiles':>12s}{'captures':>10s}{'rebinds':>9s}{'tokens':>8s}")
    print(head)
    for name, s in c.items():
        ve = c[EAGER]["median_s"] / s["median_s"] if EAGER in c else float("nan")
        vi = c[TORCH_COMPILE]["median_s"] / s["median_s"] if TORCH_COMPILE in c else float("nan")
        cap = str(s["captures"]) if name.startswith("graphgear") else "-"
        reb = str(s["rebinds"]) if name.startswith("graphgear") else "-"
        tok = "ok" if s["mismatches"] == 0 else f"{s['mismatches']} diff"
        print(f"{name:28s}{s['first_request_s']:10.2f}{s['median_s']:11.4f}{s['ms_per_token']:10.2f}"
              f"{ve:17.2f}x{vi:25.2f}x{s['recompiles']:12d}{cap:>10s}{reb:>9s}{tok:>8s}")
    print(speedup_note(EAGER, TORCH_COMPILE))
    print(f"RSS: {res['rss_mb']['after_warmup']:.1f} MB after the first request, "
          f"{res['rss_mb']['end']:.1f} MB at the end")
    misses: list[str] = []

    def target(ok: bool, what: str) -> None:
        print(f"  target {what}: {'PASS' if ok else 'FAIL'}")
        if not ok:
            misses.append(f"batch {batch}: {what}")

    if EAGER in c and REDUCE_OVERHEAD in c:
        target(c[EAGER]["median_s"] >= 2.0 * c[REDUCE_OVERHEAD]["median_s"],
               f"{REDUCE_OVERHEAD} {speedup_label(EAGER)} >= 2.0x")
    if TORCH_COMPILE in c:
        for name in (REDUCE_OVERHEAD, MAX_AUTOTUNE):
            if name in c:
                target(c[TORCH_COMPILE]["median_s"] >= 1.0 * c[name]["median_s"],
                       f"{name} {speedup_label(TORCH_COMPILE)} >= 1.0x")
    for name, s in c.items():
        if s["mismatches"]:
            misses.append(f"batch {batch}: {name} tokens differ from eager in {s['mismatches']} requests")
        if name.startswith("graphgear") and s["recompiles"]:
            misses.append(f"batch {batch}: {name} recompiled {s['recompiles']} times after request 1")
    return misses


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 4], help="space-separated")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--contenders", nargs="+", default=list(CONTENDERS), type=name_type(CONTENDERS),
                    help=f"space-separated, out of: {', '.join(CONTENDERS)}")
    ap.add_argument("--json", help="also write the results to this file, with the run's versions, threads, "
                                   "CPU and commit")
    a = ap.parse_args(argv)
    if a.requests < 2:
        ap.error(f"--requests must be at least 2 (the first request compiles), got {a.requests}")
    torch.set_num_threads(a.threads)
    results: list[dict[str, Any]] = []
    misses: list[str] = []
    for batch in a.batch_sizes:
        res = run_batch(batch, a, list(dict.fromkeys(a.contenders)))
        results.append(res)
        misses += report(res, a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": {**run_metadata(), "command": " ".join(sys.argv)}, "results": results}, f,
                      indent=1)
    if misses:
        print("\nmissed: " + "; ".join(misses))
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())

"""transformers continuous batching (``generate_batch``): eager, Inductor and graphgear side by side.

    python benchmarks/bench_continuous_batching.py [--preset small|large] [--rounds 2] [--waves 3]
        [--warmup-waves 2] [--q-pad 8] [--kv-pad 64] [--threads 1] [--contenders ...] [--json FILE]

transformers 5 ships a serving loop: a scheduler, a paged KV cache, varlen prefill and
decode mixed in one batch. It compiles its forward with ``torch.compile`` when
``ContinuousBatchingConfig(varlen_compile_config=CompileConfig(...))`` is set, so graphgear
plugs in as its backend with no code of ours in the loop. Each contender runs in a process
of its own (the loop's ``gc.collect()`` at the end of every ``generate_batch`` scans the
whole process, so contenders must not share one), one after another, ``--rounds`` times in
a rotating order; a contender's figure is its best round.

A wave is one ``generate_batch`` call of 8 prompts (5 to 13 tokens, greedy, 16 new
tokens each, ``eos_token_id=-1``) on a persistent manager. ``--warmup-waves`` waves run
first; the measured waves then bring prompts of new lengths. Printed per contender:

* seconds per wave (median of the measured waves) and tokens per second;
* of that, the loop's own ``gc.collect()`` (measured once after the waves, in that process);
* the ratio to eager and to ``torch.compile`` (their time / the contender's: higher is better);
* dynamo frame compiles and graphgear compiles and captures during the measured waves
  (after warm-up: every one is a stall a server would feel);
* whether every wave's tokens equal eager's.

``--freeze-gc`` moves everything alive after the warm-up waves out of the collector's
view (``gc.freeze()``), in every contender's process alike, eager's too.

``--q-pad`` / ``--kv-pad`` set the loop's ``q_padding_interval_size`` /
``kv_padding_interval_size``. With a compile config and 0 (transformers' default) the loop
pads every batch to ``max_batch_tokens`` queries and the whole cache's keys: docs/guides/
continuous-batching.md says why graphgear's recipe sets them.

Presets: ``small`` is a Qwen2 of hidden 256, 4 layers, 4 heads, 2 KV heads, vocab 2048,
fp32; ``large`` is hidden 896, 8 layers, 14 heads, 2 KV heads, MLP 4864, vocab 32000, bf16.
Random weights (``initializer_range=0.2``), built from a config: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from graphgear.cache.store import use_private_inductor_cache  # noqa: E402

use_private_inductor_cache()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import graphgear  # noqa: E402
from graphgear.bench.names import (  # noqa: E402
    CONTENDERS,
    name_type,
    positive_int,
    speedup_label,
    speedup_note,
)
from graphgear.env import run_metadata  # noqa: E402

EAGER, TORCH_COMPILE, MAX_AUTOTUNE, REDUCE_OVERHEAD, SERVE = CONTENDERS
DEFAULT_CONTENDERS = [EAGER, TORCH_COMPILE, MAX_AUTOTUNE, REDUCE_OVERHEAD]

PRESETS: dict[str, dict[str, Any]] = {
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=512, vocab_size=2048, dtype="float32"),
    "large": dict(hidden_size=896, num_hidden_layers=8, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=32000, dtype="bfloat16"),
}
PROMPTS_PER_WAVE = 8
NEW_TOKENS = 16


def build_model(preset: str) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    p = dict(PRESETS[preset])
    dtype = getattr(torch, p.pop("dtype"))
    cfg = Qwen2Config(**p, initializer_range=0.2, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(dtype).eval()


def wave_prompts(seed: int, vocab: int) -> list[list[int]]:
    """8 prompts of 5 to 13 tokens, the same for every contender."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 14, (PROMPTS_PER_WAVE,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def compile_config(name: str) -> Any:
    from transformers import CompileConfig

    if name == EAGER:
        return None
    if name == TORCH_COMPILE:
        return CompileConfig(backend="inductor", mode="default")
    if name == SERVE:
        return CompileConfig(backend="graphgear", mode=None, options={
            "mode": "reduce-overhead", "frozen_parameter": True,
            "guard_filter_fn": graphgear.inference.serving_guard_filter})
    mode = {REDUCE_OVERHEAD: "reduce-overhead", MAX_AUTOTUNE: "max-autotune"}[name]
    return CompileConfig(backend="graphgear", mode=None, options={"mode": mode})


def _counts() -> tuple[int, int, int]:
    """(dynamo frames compiled, graphgear compiles, graphgear captures) so far."""
    from torch._dynamo.utils import counters

    graphs = graphgear.stats().graphs
    return (int(counters["frames"]["ok"]), sum(g.compiles for g in graphs), sum(g.captures for g in graphs))


def worker(name: str, a: argparse.Namespace) -> dict[str, Any]:
    """One contender in this process: warm-up waves, then the measured waves."""
    import gc

    from transformers import ContinuousBatchingConfig, GenerationConfig

    torch.set_num_threads(a.threads)
    model = build_model(a.preset)
    vocab = model.config.vocab_size
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cbc = ContinuousBatchingConfig(varlen_compile_config=compile_config(name), use_cuda_graph=False,
                                   num_blocks=64, max_batch_tokens=64,
                                   q_padding_interval_size=a.q_pad, kv_padding_interval_size=a.kv_pad)

    def wave(seed: int) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        out = model.generate_batch(wave_prompts(seed, vocab), generation_config=gen,
                                   continuous_batching_config=cbc, persistent_manager=True)
        dt = time.perf_counter() - t0
        return dt, [out[k].generated_tokens for k in sorted(out, key=lambda r: int(r.split("_")[-1]))]

    t0 = time.perf_counter()
    for w in range(a.warmup_waves):
        wave(1000 + w)
    warmup_s = time.perf_counter() - t0
    if a.freeze_gc:  # the recipe of docs/guides/continuous-batching.md, applied to every contender alike
        gc.collect()
        gc.freeze()
    before = _counts()
    times, tokens = [], []
    for w in range(a.waves):
        dt, toks = wave(2000 + w)
        times.append(dt)
        tokens.append(toks)
    after = _counts()
    t0 = time.perf_counter()
    gc.collect()
    gc_s = time.perf_counter() - t0
    return {"name": name, "warmup_s": warmup_s, "wave_s": times, "gc_s": gc_s, "tokens": tokens,
            "frames_after_warmup": after[0] - before[0], "compiles_after_warmup": after[1] - before[1],
            "captures_after_warmup": after[2] - before[2],
            "graphs": [g.name for g in graphgear.stats().graphs]}


def run_worker(name: str, a: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--preset", a.preset,
           "--waves", str(a.waves), "--warmup-waves", str(a.warmup_waves), "--threads", str(a.threads),
           "--q-pad", str(a.q_pad), "--kv-pad", str(a.kv_pad)] + (["--freeze-gc"] if a.freeze_gc else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        raise RuntimeError(f"contender {name} failed (exit {proc.returncode})")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--rounds", type=positive_int, default=2)
    ap.add_argument("--waves", type=positive_int, default=3)
    ap.add_argument("--warmup-waves", type=positive_int, default=2)
    ap.add_argument("--q-pad", type=int, default=8, help="q_padding_interval_size (0: pad to max_batch_tokens)")
    ap.add_argument("--kv-pad", type=int, default=64, help="kv_padding_interval_size (0: pad to the cache)")
    ap.add_argument("--freeze-gc", action="store_true",
                    help="gc.freeze() after the warm-up waves, in every contender's process")
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--contenders", nargs="+", default=DEFAULT_CONTENDERS, type=name_type(CONTENDERS),
                    help=f"space-separated, out of: {', '.join(CONTENDERS)}")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the results to this file, with the run's versions and CPU")
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.worker, a)))
        return 0
    names = list(dict.fromkeys(a.contenders))
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            runs[name].append(run_worker(name, a))
    best = {n: min(rs, key=lambda x: statistics.median(x["wave_s"])) for n, rs in runs.items()}
    med = {n: statistics.median(b["wave_s"]) for n, b in best.items()}
    ref_tokens = best[EAGER]["tokens"] if EAGER in best else None
    print(f"\ncontinuous batching, preset {a.preset}: {a.waves} waves x {PROMPTS_PER_WAVE} prompts x "
          f"{NEW_TOKENS} new tokens after {a.warmup_waves} warm-up waves; q_padding_interval_size={a.q_pad}, "
          f"kv_padding_interval_size={a.kv_pad}; gc.freeze() after warm-up: {'yes' if a.freeze_gc else 'no'}; "
          f"{a.threads} thread(s); best of {a.rounds} rounds")
    se, stc = speedup_label(EAGER, direction=False), speedup_label(TORCH_COMPILE, direction=False)
    print(f"{'contender':28s}{'warm-up s':>10s}{'s/wave':>9s}{'gc s':>7s}{'tokens/s':>10s}{se:>18s}{stc:>26s}"
          f"{'frames':>8s}{'compiles':>10s}{'captures':>10s}{'tokens':>8s}")
    misses: list[str] = []
    for n, b in best.items():
        ve = med[EAGER] / med[n] if EAGER in med else float("nan")
        vi = med[TORCH_COMPILE] / med[n] if TORCH_COMPILE in med else float("nan")
        same = ref_tokens is None or b["tokens"] == ref_tokens
        tps = PROMPTS_PER_WAVE * NEW_TOKENS / med[n]
        gg = n.startswith("graphgear")
        print(f"{n:28s}{b['warmup_s']:10.1f}{med[n]:9.3f}{b['gc_s']:7.3f}{tps:10.0f}{ve:17.2f}x{vi:25.2f}x"
              f"{b['frames_after_warmup']:8d}{b['compiles_after_warmup'] if gg else '-':>10}"
              f"{b['captures_after_warmup'] if gg else '-':>10}{'equal' if same else 'DIFFER':>8s}")
        if not same and PRESETS[a.preset]["dtype"] == "float32":
            misses.append(f"{n}: tokens differ from eager")
        if b["frames_after_warmup"] or (gg and (b["compiles_after_warmup"] or b["captures_after_warmup"])):
            misses.append(f"{n}: compiled or captured after warm-up")
    print(speedup_note(EAGER, TORCH_COMPILE))
    print("frames / compiles / captures: during the measured waves (after warm-up); gc s: one gc.collect() "
          "of that process, which generate_batch runs once per wave")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": {**run_metadata(), "command": " ".join(sys.argv)}, "runs": runs}, f, indent=1)
    if misses:
        print("\nmissed: " + "; ".join(misses))
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())

"""graphgear-max-autotune beside torch.compile's default (Inductor) on the embedded
decoder step: batch 1, one token, tensor positions, ``torch.no_grad()``.

Measured in one run, interleaved (each round times every variant in turn), one thread
by default. Reports the median step time of each variant, its speedup vs
``torch.compile`` (its default; torch.compile's time / the variant's: higher is better),
and the compile seconds of graphgear-max-autotune cold (a
new, empty Inductor cache dir, in a fresh process) and warm (a fresh process on the
cache the cold run filled).

    python benchmarks/bench_max_autotune.py [--rounds 7] [--iters 300] [--threads 1]
        [--no-compile-times] [--patches]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from graphgear.cache.store import use_private_inductor_cache  # noqa: E402

use_private_inductor_cache()  # before torch: importing torch._dynamo fixes the cache folder

import torch  # noqa: E402

import graphgear  # noqa: E402
from graphgear.bench.names import CONTENDERS, speedup_label, speedup_note  # noqa: E402
from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder  # noqa: E402

EAGER, TORCH_COMPILE, MAX_AUTOTUNE = CONTENDERS[:3]


def step_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([[7]]), torch.tensor([5])


def graphgear_backend(fx_passes: bool, disabled: tuple[str, ...] = ()) -> Any:
    cfg = graphgear.CompilerConfig()
    cfg.mode = "max-autotune"
    cfg.experimental_config.fx_passes = fx_passes
    cfg.experimental_config.disabled_passes = disabled
    return graphgear.get_backend(cfg)


def build_variants(model: ToyDecoder, with_patches: bool) -> dict[str, Callable[..., Any]]:
    torch._dynamo.reset()
    graphgear.reset()
    variants: dict[str, Callable[..., Any]] = {EAGER: model}
    variants[TORCH_COMPILE] = torch.compile(copy.deepcopy(model))
    variants[MAX_AUTOTUNE] = torch.compile(
        copy.deepcopy(model), backend=graphgear_backend(False))
    variants[f"{MAX_AUTOTUNE} +fx_passes"] = torch.compile(
        copy.deepcopy(model), backend=graphgear_backend(True))
    variants[f"{MAX_AUTOTUNE} +fx_passes -attention_fusion"] = torch.compile(
        copy.deepcopy(model), backend=graphgear_backend(True, ("attention_fusion",)))
    if with_patches:
        for name, patch in (("freezing", {"freezing": True}),
                            ("cpp_wrapper", {"cpp_wrapper": True}),
                            ("max_autotune_gemm", {"max_autotune": True,
                                                   "max_autotune_gemm_backends": "CPP,ATEN"})):
            m = torch.compile(copy.deepcopy(model), backend=graphgear_backend(False))
            with torch.no_grad(), torch._inductor.config.patch(patch):
                m(*step_inputs())  # compile under the patch
            variants[f"{MAX_AUTOTUNE} +{name}"] = m
    return variants


def time_variants(variants: dict[str, Callable[..., Any]], rounds: int, iters: int) -> dict[str, float]:
    tok, pos = step_inputs()
    samples: dict[str, list[float]] = {k: [] for k in variants}
    with torch.no_grad():
        ref = variants[EAGER](tok, pos)
        for name, fn in variants.items():
            for _ in range(3):
                out = fn(tok, pos)
            err = (out - ref).abs().max().item()
            if err > 1e-4:
                raise SystemExit(f"{name}: output differs from eager by {err}")
        for _ in range(rounds):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn(tok, pos)
                samples[name].append((time.perf_counter() - t0) / iters)
    return {k: statistics.median(v) for k, v in samples.items()}


def compile_seconds_child(fx_passes: bool) -> None:
    """Run in a fresh process: compile the decoder step once, print the seconds."""
    torch.manual_seed(0)
    model = ToyDecoder(DecoderConfig())
    f = torch.compile(model, backend=graphgear_backend(fx_passes))
    t0 = time.perf_counter()
    with torch.no_grad():
        f(*step_inputs())
    print(json.dumps({"seconds": time.perf_counter() - t0}))


def compile_seconds(fx_passes: bool) -> tuple[float, float]:
    cache = tempfile.mkdtemp(prefix="gg-bench-inductor-")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
    cmd = [sys.executable, __file__, "--child-compile"] + (["--fx-passes"] if fx_passes else [])
    out = []
    for _ in range(2):  # cold, then warm on the same cache
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        out.append(json.loads(res.stdout.strip().splitlines()[-1])["seconds"])
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-compile-times", action="store_true")
    ap.add_argument("--patches", action="store_true",
                    help="also time Inductor option patches (freezing, cpp_wrapper, CPP GEMM)")
    ap.add_argument("--child-compile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fx-passes", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child_compile:
        compile_seconds_child(args.fx_passes)
        return
    torch.manual_seed(0)
    model = ToyDecoder(DecoderConfig())
    variants = build_variants(model, args.patches)
    times = time_variants(variants, args.rounds, args.iters)
    base = times[TORCH_COMPILE]
    print(f"decoder step (batch 1, 1 token, {args.threads} thread(s)), median of {args.rounds} "
          f"rounds x {args.iters} calls")
    label = speedup_label(TORCH_COMPILE, direction=False)
    print(f"{'variant':48s} {'us/step':>9s} {label:>25s}")
    for name, t in times.items():
        print(f"{name:48s} {t * 1e6:9.1f} {base / t:24.2f}x")
    print(speedup_note(TORCH_COMPILE))
    if not args.no_compile_times:
        for fx in (False, True):
            cold, warm = compile_seconds(fx)
            print(f"{MAX_AUTOTUNE} compile{' (fx_passes)' if fx else ''}: "
                  f"cold {cold:.1f}s, warm {warm:.1f}s")


if __name__ == "__main__":
    main()

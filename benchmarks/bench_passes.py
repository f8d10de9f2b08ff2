"""What graphgear's FX passes buy on the embedded decoder step (batch 1, one token,
tensor positions, ``torch.no_grad()``), in both modes, measured side by side.

For each mode (``max-autotune``, ``reduce-overhead``) and for ``debug.run_eagerly``
(the optimised FX graph run op by op, which shows what the passes do to the op count
without any code generation), it times: passes off (``fx_passes=False``), all passes
on, and all on but one fusion. It also prints, per variant, the joint-pass match counts
and the aten op count of the graph before and after the passes.

    python benchmarks/bench_passes.py [--rounds 7] [--iters 200] [--threads 1]
        [--modes max-autotune reduce-overhead run_eagerly]

Each variant's speedup is vs the same mode with passes off (that time / the variant's:
higher is better).

Measured (2-core CPU shared with other jobs, torch 2.13; run-to-run noise 10-20 %):
in max-autotune the passes took 0.87x-1.10x the time of passes off, in reduce-overhead
0.98x-1.23x (1.17-1.23x while attention still became SDPA on the CPU: that rewrite is now
off there),
i.e. no gain on the CPU, where Inductor already fuses RMSNorm, rotary and attention into
generated code and ATen has no fused RMSNorm kernel. Ops in the graph: 198 -> 174
(rotary) and -> 144 with SDPA under run_eagerly.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

from graphgear.cache.store import use_private_inductor_cache  # noqa: E402

use_private_inductor_cache()  # before torch: importing torch._dynamo fixes the cache folder

import torch  # noqa: E402

import graphgear  # noqa: E402
from graphgear.bench.names import name_type, speedup_label  # noqa: E402
from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder  # noqa: E402

FUSIONS = ("rms_norm_fusion", "rotary_fusion", "attention_fusion")
MODES = ("max-autotune", "reduce-overhead", "run_eagerly")


def make(model: ToyDecoder, mode: str, fx_passes: bool, disabled: tuple[str, ...]) -> tuple[Any, dict]:
    cfg = graphgear.CompilerConfig()
    if mode == "run_eagerly":
        cfg.mode = "reduce-overhead"
        cfg.debug.run_eagerly = True
    else:
        cfg.mode = mode
    cfg.experimental_config.fx_passes = fx_passes
    cfg.experimental_config.disabled_passes = disabled
    m = copy.deepcopy(model)
    f = torch.compile(m, backend=graphgear.get_backend(cfg))
    j0 = len(graphgear.stats().joint)
    n0 = len(graphgear.stats().graphs)
    with torch.no_grad():
        for _ in range(3):  # compile, warm up, capture
            f(torch.tensor([[7]]), torch.tensor([5]))
    joint = graphgear.stats().joint[j0:]
    info: dict[str, Any] = {"joint": dict(joint[-1]) if joint else None}
    recs = graphgear.stats().graphs[n0:]
    info["ops_after_passes"] = recs[-1].num_nodes if recs else None
    return f, info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", nargs="+", type=name_type(MODES, "mode"), default=list(MODES),
                    help=f"space-separated, out of: {', '.join(MODES)}")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # every variant compiles the same forward: let dynamo keep them all
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 256
    torch.manual_seed(0)
    model = ToyDecoder(DecoderConfig())
    tok, pos = torch.tensor([[7]]), torch.tensor([5])
    variants: dict[str, Any] = {}
    infos: dict[str, dict] = {}
    variants["eager"] = copy.deepcopy(model)
    for mode in dict.fromkeys(args.modes):
        torch._dynamo.reset()
        specs = [("passes off", False, ()), ("fx_passes on", True, ())]
        specs += [(f"on, no {f}", True, (f,)) for f in FUSIONS]
        for label, fx, disabled in specs:
            name = f"{mode}: {label}"
            try:
                variants[name], infos[name] = make(model, mode, fx, disabled)
            except Exception as e:  # a mode that cannot run here is reported, not fatal
                print(f"{name}: could not compile: {type(e).__name__}: {str(e)[:200]}")
    with torch.no_grad():
        ref = variants["eager"](tok, pos)
        for name, fn in variants.items():
            err = (fn(tok, pos) - ref).abs().max().item()
            if err > 1e-4:
                raise SystemExit(f"{name}: output differs from eager by {err}")
        samples: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    fn(tok, pos)
                samples[name].append((time.perf_counter() - t0) / args.iters)
    times = {k: statistics.median(v) for k, v in samples.items()}
    print(f"decoder step (batch 1, 1 token, {args.threads} thread(s)), median of {args.rounds} "
          f"rounds x {args.iters} calls; {speedup_label('passes off')}: the same mode's time with "
          "passes off / the variant's")
    label = speedup_label("passes off", direction=False)
    print(f"{'variant':46s} {'us/step':>8s} {label:>22s}  {'ops before->after':>18s}  matches")
    for name, t in times.items():
        mode = name.split(":")[0]
        base = times.get(f"{mode}: passes off", t)
        info = infos.get(name, {})
        joint = info.get("joint")
        ops = f"{joint['nodes_before']}->{joint['nodes_after']}" if joint else "-"
        matches = {k.replace("_fusion", ""): v for k, v in joint["matches"].items()
                   if k.endswith("_fusion")} if joint else ""
        print(f"{name:46s} {t * 1e6:8.1f} {base / t:21.2f}x  {ops:>18s}  {matches}")


if __name__ == "__main__":
    main()

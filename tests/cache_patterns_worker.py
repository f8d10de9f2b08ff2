"""A fresh process for tests/test_cache_patterns.py: serve one of the patterns TorchAir's
users write (tests/models/cache_users.py) through ``cache_compile``, with gears set on the
first call's tensor and the other sizes arriving one call at a time as plain tensors; print
one JSON line: per call the output's sha256 and its distance to eager, the stats records'
cache fields, and dynamo's trace counters."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphgear.cache.store import use_private_inductor_cache  # noqa: E402

use_private_inductor_cache()

import torch  # noqa: E402

T0 = time.perf_counter()  # "ready" is measured from here: import graphgear to the last output
import graphgear  # noqa: E402
from graphgear.inference import cache_compile  # noqa: E402
from tests.models import cache_users  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("pattern", choices=["method", "function", "module", "host-read", "two-states", "hf-closure",
                                       "hf-forward", "hf-static-cache"])
    p.add_argument("--mode", default="max-autotune")
    p.add_argument("--dir", required=True)
    p.add_argument("--sizes", default="4,2,8")
    p.add_argument("--gears", default="2,4,8")
    p.add_argument("--split-sdpa", action="store_true",
                   help="reduce-overhead in pieces, split at the CPU's flash SDPA (issue 36's case)")
    a = p.parse_args()
    torch.manual_seed(0)
    cfg = graphgear.CompilerConfig()
    cfg.mode = a.mode
    if a.split_sdpa:
        cfg.capture_config.mode = "piecewise"
        cfg.capture_config.split_ops = ["aten._scaled_dot_product_flash_attention_for_cpu"]
    gears = [int(s) for s in a.gears.split(",")]
    sizes = [int(s) for s in a.sizes.split(",")]
    w = torch.randn(16, 16)
    hf = None
    if a.pattern in ("hf-closure", "hf-forward"):
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

        hf = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=4, intermediate_size=64,
                                              max_position_embeddings=64)).eval()
    if a.pattern == "hf-static-cache":
        return _static_cache_decode(cfg, a.dir, steps=len(sizes))
    if a.pattern == "method":
        model = cache_users.SelfCachedMLP(cfg, a.dir).eval()
        served, eager = model, model._forward
    elif a.pattern in ("module", "host-read", "two-states"):
        model = {"module": cache_users.MLP, "host-read": cache_users.HostReadMLP,
                 "two-states": cache_users.TwoStateMLP}[a.pattern]().eval()
        served, eager = cache_compile(model, config=cfg, cache_dir=a.dir), model
    elif a.pattern == "function":
        served = cache_compile(cache_users.mlp_function, config=cfg, cache_dir=a.dir)
        eager = cache_users.mlp_function
    elif a.pattern == "hf-closure":
        fn = cache_users.logits_of(hf)
        served, eager = cache_compile(fn, config=cfg, cache_dir=a.dir), fn
    else:
        assert hf is not None
        served, eager = cache_compile(hf.forward, config=cfg, cache_dir=a.dir), hf.forward
    calls = []
    for i, b in enumerate(sizes):
        g = torch.Generator().manual_seed(b)
        if hf is not None:
            x = torch.randint(0, 128, (b, 6), generator=g)
        else:
            x = torch.randn(b, 16, generator=g)
        if i == 0:
            graphgear.set_dim_gears(x, {0: gears})
        if a.pattern == "two-states":
            model.residual = i % 2 == 1  # type: ignore[union-attr]
        args: tuple = {"function": (x, w), "hf-forward": ()}.get(a.pattern, (x,))
        kwargs: dict = {"input_ids": x} if a.pattern == "hf-forward" else {}
        out = served(*args, **kwargs)
        with torch.no_grad():
            ref = eager(*args, **kwargs)
        if a.pattern == "hf-forward":
            out, ref = out.logits, ref.logits
        calls.append({"size": b, "sha": hashlib.sha256(out.contiguous().numpy().tobytes()).hexdigest(),
                      "err": float((out - ref).abs().max())})
    _report(calls, getattr(served, "cached_forward", served))


def _report(calls: list[dict], served: object) -> None:
    ready_s = time.perf_counter() - T0  # eager references included: the same in every process
    counters = torch._dynamo.utils.counters
    print(json.dumps({"calls": calls, "ready_s": ready_s,
                      "records": [{"name": r.name, "cache": r.cache, "reason": r.cache_reason,
                                   "loaded_keys": r.loaded_keys, "compiles": r.compiles,
                                   "pieces": len(r.pieces), "replays": r.replays}
                                  for r in graphgear.stats().graphs],
                      "unique_graphs": counters["stats"]["unique_graphs"],
                      "frames_ok": counters["frames"]["ok"],
                      "stores": getattr(served, "stores", None)}))


def _static_cache_decode(cfg: graphgear.CompilerConfig, folder: str, steps: int) -> None:
    """A transformers Llama's decode steps with a ``StaticCache`` through ``cache_compile``
    of its bound ``forward``: the first step sees the cache before transformers made its
    tensors, the later ones after (two module states, two entries). Per step: the logits'
    sha256 and distance to eager; at the end the keys' and values' distance to eager's."""
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    hf_cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(hf_cfg).eval()
    served = cache_compile(model.forward, config=cfg, cache_dir=folder)
    kv, kv_ref = StaticCache(config=hf_cfg, max_cache_len=32), StaticCache(config=hf_cfg, max_cache_len=32)
    ids = torch.randint(0, 128, (1, 1), generator=torch.Generator().manual_seed(1))
    calls = []
    with torch.no_grad():
        for pos in range(steps):
            cp = torch.tensor([pos])
            out = served(input_ids=ids, past_key_values=kv, cache_position=cp, use_cache=True).logits
            ref = model(input_ids=ids, past_key_values=kv_ref, cache_position=cp, use_cache=True).logits
            calls.append({"size": pos, "sha": hashlib.sha256(out.contiguous().numpy().tobytes()).hexdigest(),
                          "err": float((out - ref).abs().max())})
            ids = ref.argmax(-1)
    cache_err = max(float((a - b).abs().max()) for la, lb in zip(kv.layers, kv_ref.layers)
                    for a, b in ((la.keys, lb.keys), (la.values, lb.values)))
    calls.append({"size": -1, "sha": "", "err": cache_err})
    _report(calls, served)


if __name__ == "__main__":
    main()

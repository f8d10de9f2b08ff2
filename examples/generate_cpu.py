"""transformers ``generate()`` on the CPU with graphgear, in both modes.

    python examples/generate_cpu.py [--requests 4] [--new-tokens 12] [--threads 1]

A transformers Llama built from a small config (hidden 64, 2 layers, vocabulary 128,
random weights: nothing is downloaded) generates greedily with a static KV cache, first
eagerly, then with ``CompileConfig(backend="graphgear", ...)`` in ``max-autotune`` and in
``reduce-overhead``. transformers runs the prefill uncompiled and compiles the decode
step; on the CPU it compiles only with ``_compile_all_devices = True``. Every request's
tokens must equal eager's (asserted). The seconds per request are printed for
information only: the first compiled request includes the compile, and on a model this
small the numbers say little (one thread by default: on a busy machine two threads that
wait for each other make every figure noise).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from graphgear.cache.store import use_private_inductor_cache

use_private_inductor_cache()  # Inductor's on-disk cache in a folder private to this user
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402

import graphgear  # noqa: E402

VOCAB = 128
MODES = ("max-autotune", "reduce-overhead")


def build_model(seed: int = 0) -> LlamaForCausalLM:
    """A two-layer Llama with random weights."""
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def compile_config(mode: str) -> CompileConfig:
    """graphgear in ``mode``; ``mode=None`` because torch.compile takes ``mode=`` or
    ``options=``, not both."""
    cc = CompileConfig(backend="graphgear", mode=None, options={"mode": mode})
    cc._compile_all_devices = True  # the CPU: transformers compiles only when told to
    return cc


def generate(model: LlamaForCausalLM, ids: torch.Tensor, new_tokens: int,
             cc: CompileConfig | None) -> tuple[torch.Tensor, float]:
    """Greedy tokens of one request, and its seconds."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  cache_implementation="static", pad_token_id=0)
    if cc is not None:
        kwargs["compile_config"] = cc
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, **kwargs)
    return out, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=4, help="requests per mode (default 4)")
    p.add_argument("--new-tokens", type=int, default=12, help="tokens generated per request (default 12)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args()
    assert args.requests >= 2, "--requests must be at least 2 (the first one compiles)"
    torch.set_num_threads(args.threads)
    model = build_model()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, VOCAB, (1, 6), generator=gen) for _ in range(args.requests)]
    eager = [generate(model, ids, args.new_tokens, None) for ids in prompts]
    eager_s = statistics.median(s for _, s in eager[1:])
    print(f"eager: {args.requests} requests, {args.new_tokens} new tokens each, "
          f"{eager_s * 1e3:.1f} ms/request (median after the first)")
    for mode in MODES:
        graphgear.reset()
        cc = compile_config(mode)
        runs = [generate(model, ids, args.new_tokens, cc) for ids in prompts]
        for r, ((want, _), (got, _)) in enumerate(zip(eager, runs)):
            assert torch.equal(got, want), (
                f"{mode}, request {r}: tokens differ from eager's\n  eager     {want.tolist()}\n"
                f"  graphgear {got.tolist()}")
        graphs = graphgear.stats().graphs
        assert graphs, f"{mode}: graphgear compiled nothing (was the decode step compiled?)"
        assert all(g.mode == mode for g in graphs), f"{mode}: {graphgear.stats()}"
        assert not any(g.fallbacks for g in graphs), f"{mode}: a graph fell back\n{graphgear.stats()}"
        if mode == "reduce-overhead":
            # one capture; every later request's new StaticCache is rebound, not recaptured
            assert sum(g.captures for g in graphs) == 1, f"expected one capture\n{graphgear.stats()}"
        warm_s = statistics.median(s for _, s in runs[1:])
        print(f"graphgear {mode}: tokens equal eager's in all {args.requests} requests; "
              f"first request {runs[0][1]:.1f} s (compiles), then {warm_s * 1e3:.1f} ms/request "
              f"(time vs eager {warm_s / eager_s:.2f}x, lower is faster; information only); "
              f"{len(graphs)} graph(s), {sum(g.compiles for g in graphs)} compile(s), "
              f"{sum(g.captures for g in graphs)} capture(s), {sum(g.replays for g in graphs)} replay(s)")
    print("ok")


if __name__ == "__main__":
    main()

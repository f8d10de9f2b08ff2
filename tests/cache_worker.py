"""A fresh process for tests/test_cache.py and benchmarks/bench_cache.py: build the
embedded decoder (fixed seed), serve it through graphgear.inference.cache_compile, print
one JSON line (outputs' sha256, stats' cache fields, seconds from start to first output)."""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402

import torch  # noqa: E402

import graphgear  # noqa: E402
from graphgear.cachedir import use_private_inductor_cache  # noqa: E402
from graphgear.toy_decoder import DecoderConfig, ToyDecoder  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--mode", default="reduce-overhead")
    p.add_argument("--gears", default="", help="comma-separated gears of the batch dim (none by default)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--no-cache", action="store_true", help="plain graphgear torch.compile")
    p.add_argument("--torch-default", action="store_true", help="torch.compile default (Inductor)")
    p.add_argument("--precompile", action="store_true", help="build every gear before the first output")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="LOG %(name)s %(message)s")
    use_private_inductor_cache()
    torch.manual_seed(0)
    model = ToyDecoder(DecoderConfig(num_layers=a.layers)).eval()
    tokens = torch.randint(0, 512, (a.batch, 1))
    positions = torch.tensor([3])
    gears = [int(g) for g in a.gears.split(",") if g]
    mark = bool(gears) and not a.torch_default  # torch's default specialises the batch dim
    if mark:
        graphgear.set_dim_gears(tokens, {0: gears})
    config = graphgear.CompilerConfig()
    config.mode = a.mode
    if a.torch_default:
        fn = torch.compile(model)
    elif a.no_cache:
        fn = torch.compile(model, backend=graphgear.get_backend(config))
    else:
        fn = graphgear.inference.cache_compile(model, config=config, cache_dir=a.cache_dir, rank=a.rank)
    with torch.no_grad():
        if a.precompile:
            for g in gears:
                t = torch.zeros(g, 1, dtype=torch.long)
                if mark:
                    graphgear.set_dim_gears(t, {0: gears})
                fn(t, positions)
            model.reset_cache()
        out = fn(tokens, positions)
    ready = time.perf_counter() - T0
    recs = graphgear.stats().graphs
    print("RESULT " + json.dumps({
        "sha": hashlib.sha256(out.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest(),
        "cache": [r.cache for r in recs], "load_s": [r.cache_load_seconds for r in recs],
        "compiles": sum(r.compiles for r in recs), "ready_s": ready}))


if __name__ == "__main__":
    main()

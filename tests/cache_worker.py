"""A fresh process for tests/test_cache.py and benchmarks/bench_cache.py: build a model
(fixed seed: the embedded decoder, a transformers Llama with ``--model llama``, or a
one-query attention over a static cache with ``--model attention``), serve
it through graphgear.inference.cache_compile (or plain graphgear / torch.compile), print
one JSON line: outputs' sha256, stats' cache fields, how many AOTAutograd and Inductor
compiles ran, seconds from interpreter start to imports done and to the first output."""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

import graphgear  # noqa: E402
from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder  # noqa: E402
from graphgear.cache.store import use_private_inductor_cache  # noqa: E402

T_IMPORTS = time.perf_counter() - T0


def _inputs(model_kind: str, batch: int, gears: list[int], mark: bool) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def geared(t: torch.Tensor) -> torch.Tensor:
        if mark:
            graphgear.set_dim_gears(t, {0: gears})
        return t

    if model_kind == "attention":
        g = torch.Generator().manual_seed(1)
        x, k, v = (torch.randn(batch, *shape, generator=g) for shape in ((1, 8), (2, 1, 8), (2, 1, 8)))
        return (x, k, v, torch.tensor([3])), {}
    if model_kind == "llama":
        ids = geared(torch.randint(0, 128, (batch, 8), generator=torch.Generator().manual_seed(1)))
        pos = geared(torch.arange(8).repeat(batch, 1))
        return (), {"input_ids": ids, "position_ids": pos, "use_cache": False}
    tokens = geared(torch.randint(0, 512, (batch, 1), generator=torch.Generator().manual_seed(1)))
    return (tokens, torch.tensor([3])), {}


class _DecodeAttention(torch.nn.Module):
    """One-query attention over a static KV cache in buffers (grouped heads, a boolean
    mask): what graphgear's decode attention kernel takes."""

    def __init__(self, batch: int, heads: int = 4, kv_heads: int = 2, length: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(batch, kv_heads, length, dim))
        self.register_buffer("v_cache", torch.zeros(batch, kv_heads, length, dim))
        self.q = torch.nn.Linear(dim, heads * dim)
        self.heads, self.dim = heads, dim

    def reset_cache(self) -> None:
        with torch.no_grad():
            self.k_cache.zero_()
            self.v_cache.zero_()

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q = self.q(x).view(b, 1, self.heads, self.dim).transpose(1, 2)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        mask = (torch.arange(self.k_cache.shape[2]) <= pos)[None, None, None, :]
        out = torch.nn.functional.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask,
                                                               enable_gqa=True)
        return out.transpose(1, 2).reshape(b, 1, -1)


def _kernel_calls() -> int:
    """Calls of graphgear's kernels in this process's CPU graphs' kernel-call replays."""
    import gc

    from graphgear.capture import CaptureEngine
    from graphgear.cpu.kernels import decode_attention_kernel as decode_attention
    from graphgear.cpu.kernels import small_gemm_kernel as small_gemm

    ours = {decode_attention.kernel(), small_gemm.kernel()} - {None}
    return sum(c[0] in ours for o in gc.get_objects() if type(o) is CaptureEngine
               for e in o.entries.values() if e.graph is not None and e.graph.program is not None
               for c in e.graph.program.calls)


def _model(kind: str, layers: int, batch: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "attention":
        return _DecodeAttention(batch).eval()
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
        return LlamaForCausalLM(cfg).eval()
    return ToyDecoder(DecoderConfig(num_layers=layers)).eval()


def _tensor(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--model", choices=["decoder", "llama", "attention"], default="decoder")
    p.add_argument("--mode", default="reduce-overhead")
    p.add_argument("--gears", default="", help="comma-separated gears of the batch dim (none by default)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rank", type=int, default=None)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--no-cache", action="store_true", help="plain graphgear torch.compile")
    p.add_argument("--torch-default", action="store_true", help="torch.compile default (Inductor)")
    p.add_argument("--precompile", action="store_true", help="build every gear before the first output")
    p.add_argument("--steps", type=int, default=1, help="calls after the first (same input spec)")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="LOG %(name)s %(message)s")
    use_private_inductor_cache()
    from torch._dynamo.utils import counters  # the test reads how many compiles ran
    from torch._inductor import cpu_vec_isa

    probes = [0]  # Inductor's base vector-ISA probes (a child process each) this process ran
    check_build = cpu_vec_isa.VecISA.check_build

    def counted(self: Any, code: str) -> bool:
        probes[0] += code == cpu_vec_isa.VecISA._avx_code
        return check_build(self, code)

    cpu_vec_isa.VecISA.check_build = counted  # type: ignore[method-assign]

    t_model = time.perf_counter()
    model = _model(a.model, a.layers, a.batch)
    model_s = time.perf_counter() - t_model  # transformers' import and the model's build
    gears = [int(g) for g in a.gears.split(",") if g]
    mark = bool(gears) and not a.torch_default  # torch's default specialises the batch dim
    args, kwargs = _inputs(a.model, a.batch, gears, mark)
    config = graphgear.CompilerConfig()
    config.mode = a.mode
    if a.torch_default:
        fn: Any = torch.compile(model)
    elif a.no_cache:
        fn = torch.compile(model, backend=graphgear.get_backend(config))
    else:
        fn = graphgear.inference.cache_compile(model, config=config, cache_dir=a.cache_dir, rank=a.rank)
    reset = getattr(model, "reset_cache", lambda: None)
    with torch.no_grad():
        if a.precompile and mark:  # every gear built (and captured) by one call
            graphgear.inference.precompile_gears(fn, *args, **kwargs)
            reset()
        elif a.precompile:  # torch.compile: one call per gear size
            for g in gears:
                ga, gk = _inputs(a.model, g, gears, False)
                fn(*ga, **gk)
            reset()
        out = _tensor(fn(*args, **kwargs)).clone()  # a reduce-overhead output lives until the next replay
        ready = time.perf_counter() - T0
        print("READY", flush=True)  # bench_cache.py stamps the first output here (process exit excluded)
        again = out
        steps = []  # the calls after the first: captured and replayed code (the first, in
        # reduce-overhead, is the warm-up: the FX graph's ATen ops, whose sums may round
        # differently from graphgear's kernels in the compiled code)
        for _ in range(a.steps):
            reset()
            again = _tensor(fn(*args, **kwargs)).clone()
            steps.append(again)
    recs = graphgear.stats().graphs
    print("RESULT " + json.dumps({
        # the last call's output: from the compiled (or loaded) code where there were steps
        "sha": hashlib.sha256(again.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest(),
        "steady": all(torch.equal(o, again) for o in steps) and bool(torch.allclose(out, again, atol=1e-5)),
        "cache": [r.cache for r in recs], "load_s": [r.cache_load_seconds for r in recs],
        "compiles": sum(r.compiles for r in recs), "loaded_keys": sum(r.loaded_keys for r in recs),
        "captures": sum(r.captures for r in recs),
        "aot_compiles": counters["aot_autograd"]["total"],
        "inductor_compiles": counters["inductor"]["fxgraph_cache_hit"] + counters["inductor"]["fxgraph_cache_miss"]
        + counters["inductor"]["fxgraph_cache_bypass"],
        "isa_probes": probes[0], "kernel_calls": _kernel_calls(), "stores": getattr(fn, "stores", 0), "imports_s": T_IMPORTS, "model_s": model_s, "ready_s": ready}))


if __name__ == "__main__":
    main()

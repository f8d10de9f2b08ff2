"""How many times each joint-graph fusion fires, per model, mode and graph kind, with
every output and gradient checked against eager PyTorch (a relative error above 1e-4,
against the largest value of the tensor, stops the run).

Models: the embedded toy decoder (one decode step), and transformers Llama, GPT-2 and
Qwen2 (2 layers, random weights, eager attention, ids of shape (2, 8)). Graph kinds:
``inference`` (``torch.no_grad()``), ``training`` (static shapes) and
``training-dynamic`` (batch marked dynamic); the ``fused on`` column says whether a
training graph's fusions ran on the forward before AOTAutograd differentiated it
(``pre-grad``) or on the joint forward+backward graph (``joint``). Modes: ``run_eagerly`` (aten graphs as
AOTAutograd gives them; reduce-overhead sees the same graphs) and ``max-autotune``
(Inductor's decompositions applied first).

By default the attention fusion is measured everywhere (``--device-skip`` keeps
graphgear's rule that leaves attention to Inductor on the CPU outside run_eagerly,
which makes every max-autotune attention count 0 here), and the RMSNorm fusion is
allowed on the CPU (where ``_fused_rms_norm`` has no kernel of its own), so the
counts show what the matchers find.

    python benchmarks/fusion_matches.py [--models toy llama gpt2 qwen2]
        [--modes run_eagerly max-autotune] [--kinds inference training training-dynamic]
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from typing import Any

from graphgear.cache.store import use_private_inductor_cache  # noqa: E402

use_private_inductor_cache()  # before torch: importing torch._dynamo fixes the cache folder

import torch  # noqa: E402
from torch import nn  # noqa: E402

import graphgear  # noqa: E402
import graphgear.passes.joint as joint  # noqa: E402
from graphgear.bench.names import name_type  # noqa: E402
from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder  # noqa: E402

FUSIONS = ("rms_norm_fusion", "rotary_fusion", "attention_fusion")
MODELS = ("toy", "llama", "gpt2", "qwen2")
MODES = ("run_eagerly", "max-autotune")
KINDS = ("inference", "training", "training-dynamic")


def _hf(which: str) -> nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    if which == "gpt2":
        cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
        return tf.GPT2LMHeadModel(cfg)
    kw: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                              max_position_embeddings=64, attn_implementation="eager")
    if which == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**kw))
    return tf.Qwen2ForCausalLM(tf.Qwen2Config(**kw))


def _model(which: str) -> tuple[nn.Module, Callable[[], list[torch.Tensor]], Callable[[Any], torch.Tensor]]:
    if which == "toy":
        torch.manual_seed(0)
        return (ToyDecoder(DecoderConfig(num_layers=2)),
                lambda: [torch.tensor([[3], [4]]), torch.tensor([5])], lambda out: out)
    return _hf(which), lambda: [torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))], \
        lambda out: out.logits


def _config(mode: str) -> graphgear.CompilerConfig:
    opts: dict[str, Any] = {"mode": "reduce-overhead", "debug.run_eagerly": True} \
        if mode == "run_eagerly" else {"mode": mode}
    return graphgear.CompilerConfig.from_dict({**opts, "experimental_config.fx_passes": True})


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def run(which: str, mode: str, kind: str) -> tuple[dict[str, int], str, float, float]:
    """(matches, the graphs the fusions ran on, max relative output error, max relative
    gradient error) of one compile."""
    model, inputs, logits = _model(which)
    ref = copy.deepcopy(model)
    train = kind != "inference"
    model.train(train)
    ref.train(train)
    graphgear.reset()
    torch.compiler.reset()
    compiled = torch.compile(model, backend=graphgear.get_backend(_config(mode)))
    args = inputs()
    if kind == "training-dynamic":
        torch._dynamo.mark_dynamic(args[0], 0)  # symbolic batch: the joint graph's passes
    with torch.set_grad_enabled(train):
        out, expected = logits(compiled(*args)), logits(ref(*inputs()))
    out_err = _max_rel(out.detach(), expected.detach())
    grad_err = 0.0
    if train:
        out.square().mean().backward()
        expected.square().mean().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            if q.grad is None:
                continue
            grad_err = max(grad_err, _max_rel(p.grad, q.grad))
    entries = graphgear.stats().joint
    picked = [e for e in entries if e["training"] == train]
    if not picked:
        raise SystemExit(f"{which} {mode} {kind}: no joint-pass run of that kind: {entries}")
    matches = {f: sum(e["matches"].get(f, 0) for e in picked) for f in FUSIONS}
    path = "no grad" if not train else "+".join(sorted({"pre-grad" if e["pre_grad"] else "joint" for e in picked}))
    return matches, path, out_err, grad_err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, allowed, what in (("--models", MODELS, "model"), ("--modes", MODES, "mode"),
                                ("--kinds", KINDS, "graph kind")):
        ap.add_argument(flag, nargs="+", type=name_type(allowed, what), default=list(allowed),
                        help=f"space-separated, out of: {', '.join(allowed)}")
    ap.add_argument("--device-skip", action="store_true",
                    help="keep graphgear's rule: no SDPA on the CPU outside run_eagerly")
    args = ap.parse_args()
    torch.set_num_threads(1)
    joint.fused_rms_norm_kernel = lambda device: True  # count RMSNorm matches on the CPU too
    if not args.device_skip:
        joint.attention_skip_devices = lambda config: ()
    print(f"{'model':6s} {'mode':13s} {'graphs':17s} {'fused on':8s} {'rms':>4s} {'rope':>4s} {'attn':>4s} "
          f"{'out err':>8s} {'grad err':>8s} {'s':>5s}")
    for which in dict.fromkeys(args.models):
        for mode in dict.fromkeys(args.modes):
            for kind in dict.fromkeys(args.kinds):
                t0 = time.perf_counter()
                m, path, oe, ge = run(which, mode, kind)
                if max(oe, ge) > 1e-4:
                    raise SystemExit(f"{which} {mode} {kind}: differs from eager by {max(oe, ge):.1e} "
                                     "(relative to the largest value)")
                print(f"{which:6s} {mode:13s} {kind:17s} {path:8s} {m['rms_norm_fusion']:4d} "
                      f"{m['rotary_fusion']:4d} {m['attention_fusion']:4d} {oe:8.1e} {ge:8.1e} "
                      f"{time.perf_counter() - t0:5.1f}", flush=True)


if __name__ == "__main__":
    main()

"""max-autotune: every graph (forward, backward, inference) compiled by Inductor after
graphgear's passes; correct against eager, training included; Inductor's on-disk cache
serves a second process.

Inductor compiles are the slow part: the models are small and the cache is shared
(tests/conftest.py), so a warm run takes a few seconds per model.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import graphgear
from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder
from tests.helpers import assert_close


def mat_config(**experimental: object) -> graphgear.CompilerConfig:
    cfg = graphgear.CompilerConfig()
    cfg.mode = "max-autotune"
    for k, v in experimental.items():
        setattr(cfg.experimental_config, k, v)
    return cfg


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    graphgear.reset()
    yield
    graphgear.reset()


def check_training(model: nn.Module, *inputs: torch.Tensor, cfg: graphgear.CompilerConfig,
                   reduction: int = 64, steps: int = 2, cancelling: tuple[str, ...] = ()) -> None:
    """``cancelling``: parameters whose gradient is zero in exact arithmetic (a bias before
    a norm); theirs is rounding noise, judged at the scale of the model's largest gradient."""
    ref = copy.deepcopy(model)
    f = torch.compile(model, backend=graphgear.get_backend(cfg))
    for step in range(steps):  # the second call runs the compiled graphs again
        out, expected = f(*inputs), ref(*inputs)
        assert_close(out, expected, reduction=reduction)
        out.square().mean().backward()
        expected.square().mean().backward()
        top = max(float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert_close(p.grad, q.grad, reduction=100 * reduction, what=f"step {step}: {name}",
                         scale=top if name in cancelling else None)
        model.zero_grad()
        ref.zero_grad()
    stages = [(g.stage, g.mode) for g in graphgear.stats().graphs]
    assert ("forward", "max-autotune") in stages and ("backward", "max-autotune") in stages


def test_mlp_training_and_inference():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(4, 16)
    check_training(model, x, cfg=mat_config())
    torch._dynamo.reset()
    f = torch.compile(model, backend=graphgear.get_backend(mat_config()))
    with torch.no_grad():
        assert_close(f(x), model(x), reduction=32)
    rec = graphgear.stats().graphs[-1]
    assert rec.stage == "inference" and rec.mode == "max-autotune" and rec.compiles == 1


def test_dropout_in_training_draws_fresh_masks_that_forward_and_backward_share():
    """Inductor lowers random ops only after its ``replace_random`` rewrite, which
    ``compile_fx`` runs before ``compile_fx_inner``: graphgear calls the latter, and a
    model with dropout in training mode failed in Inductor's lowering."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5))
    x = torch.randn(32, 16)
    f = torch.compile(model, backend=graphgear.get_backend(mat_config()))
    masks = []
    for _ in range(3):
        out = f(x)
        out.sum().backward()
        keep = out != 0
        masks.append(keep)
        assert 0.35 < float(keep.float().mean()) < 0.65
        # the backward used the forward's mask: d out / d W = mask * 2 (1 / (1 - p)) per row
        assert_close(model[0].weight.grad, (keep.float() * 2).T @ x, reduction=64)
        # kept values are the linear layer's, scaled by 2
        assert_close(out[keep], (2 * (x @ model[0].weight.T + model[0].bias))[keep].detach(), reduction=64)
        model.zero_grad()
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    with torch.no_grad():  # the inference graph too
        a, b = f(x), f(x)
    assert not torch.equal(a != 0, b != 0)
    torch.manual_seed(7)
    with torch.no_grad():
        c = f(x)
    torch.manual_seed(7)
    with torch.no_grad():
        assert torch.equal(f(x), c)  # seeded: the same draw


def test_retain_graph_backward_is_not_served_code_that_overwrites_saved_activations():
    """A plain ``backward()`` lets Inductor's backward reuse saved activations' memory
    (donated buffers); a ``retain_graph=True`` one must not. Inductor's FX graph cache key
    leaves that out: a second model of the same architecture (or a later process) got the
    first one's backward, and its second backward read overwritten activations."""
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))

    torch.manual_seed(100)
    x, t = torch.randn(8, 16), torch.randn(8, 4)
    first = torch.compile(make(), backend=graphgear.get_backend(mat_config()))
    ((first(x) - t) ** 2).mean().backward()  # compiles (and caches) the donating backward
    torch._dynamo.reset()
    graphgear.reset()
    model, ref = make(), make()
    f = torch.compile(model, backend=graphgear.get_backend(mat_config()))
    for m in (f, ref):
        loss = ((m(x) - t) ** 2).mean()
        loss.backward(retain_graph=True)
        loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, reduction=64, what=name)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2)
        self.fc = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.fc(x.mean((2, 3)))


def test_conv_net_training():
    torch.manual_seed(0)
    check_training(ConvNet(), torch.randn(2, 3, 12, 12), cfg=mat_config(), cancelling=("conv1.bias",))


def test_decoder_inference_with_kv_cache_and_passes():
    torch.manual_seed(0)
    model = ToyDecoder(DecoderConfig(num_layers=2))
    ref = copy.deepcopy(model)
    f = torch.compile(model, backend=graphgear.get_backend(mat_config(fx_passes=True)))
    with torch.no_grad():
        for p in range(4):  # decode steps: one compile, the cache written in place each step
            tok, pos = torch.tensor([[p + 3]]), torch.tensor([p])
            assert_close(f(tok, pos), ref(tok, pos), reduction=1024)
    for a, b in zip(model.layers, ref.layers):
        assert_close(a.attn.k_cache, b.attn.k_cache, reduction=512)
    (entry,) = graphgear.stats().joint
    assert entry["kind"] == "inductor"
    assert entry["matches"]["rms_norm_fusion"] == 0  # no fused RMSNorm kernel on the CPU
    assert entry["matches"]["rotary_fusion"] == 4
    # Inductor's own attention code is faster than the CPU SDPA kernel: not rewritten
    assert entry["matches"]["attention_fusion"] == 0
    (rec,) = graphgear.stats().graphs
    assert rec.compiles == 1 and rec.mode == "max-autotune"


def test_decoder_training():
    torch.manual_seed(0)
    model = ToyDecoder(DecoderConfig(num_layers=1, hidden_size=64, intermediate_size=128))
    # one step: a KV cache written under grad carries the step's graph (eager as well)
    check_training(model, torch.tensor([[3, 4]]), torch.tensor([0, 1]), cfg=mat_config(fx_passes=True),
                   steps=1)
    (entry,) = graphgear.stats().joint
    assert entry["training"] and entry["matches"]["rotary_fusion"] == 2


def test_compile_inductor_takes_a_static_graph():
    """The gear dispatcher hands compile_inductor one static graph per gear."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphgear.pipeline import compile_graph

    def f(x, w):
        return torch.relu(x @ w).sum(-1)

    outs = []
    for batch in (1, 4):
        x, w = torch.randn(batch, 8), torch.randn(8, 8)
        gm = make_fx(f)(x, w)
        fn = compile_graph(gm, [x, w], config=mat_config(), stage="inference", static_inputs=[1])
        outs.append((fn(x, w), f(x, w)))
    for got, want in outs:
        assert_close(got[0] if isinstance(got, (list, tuple)) else got, want, reduction=8)
    assert [g.compiles for g in graphgear.stats().graphs] == [1, 1]


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, attn_implementation="eager"))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


class Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids).logits


@pytest.mark.slow
@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_transformers_training(which):
    torch.manual_seed(0)
    model = Logits(_llama() if which == "llama" else _gpt2())
    model.train()
    check_training(model, torch.randint(0, 128, (2, 8)), cfg=mat_config(fx_passes=True))


@pytest.mark.slow
def test_llama_static_cache_generate():
    torch.manual_seed(0)
    model = _llama().eval()
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
        model.forward = torch.compile(model.forward, backend=graphgear.get_backend(mat_config(fx_passes=True)))
        got = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert got.tolist() == expected.tolist()


@pytest.mark.slow
def test_second_process_compiles_from_the_disk_cache():
    """A new process with the same TORCHINDUCTOR_CACHE_DIR hits Inductor's FX graph cache."""
    script = textwrap.dedent("""
        import json, time, torch, graphgear
        from torch._dynamo.utils import counters
        from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder
        torch.manual_seed(0)
        cfg = graphgear.CompilerConfig(); cfg.mode = "max-autotune"
        f = torch.compile(ToyDecoder(DecoderConfig(num_layers=1)), backend=graphgear.get_backend(cfg))
        t0 = time.perf_counter()
        with torch.no_grad():
            f(torch.tensor([[3]]), torch.tensor([1]))
        print(json.dumps({"seconds": time.perf_counter() - t0,
                          "hit": counters["inductor"]["fxgraph_cache_hit"],
                          "miss": counters["inductor"]["fxgraph_cache_miss"]}))
    """)
    env = dict(os.environ)
    runs = []
    for _ in range(2):  # the first may fill the cache; the second must hit it
        res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    warm = runs[1]
    assert warm["hit"] >= 1 and warm["miss"] == 0, runs
    assert warm["seconds"] < 15, runs

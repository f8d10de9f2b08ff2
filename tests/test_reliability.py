"""Reliability fixes from the project tracker, one section per group of items; every
result is checked against eager PyTorch."""

from __future__ import annotations

import re

import pytest
import torch
from torch import fx

import graphgear
from graphgear import GearError
from tests.helpers import assert_close

aten = torch.ops.aten

# ---- passes, gears and backend (items 6, 8, 12, 13, 14, 15) ----

MODES = ["eager", "max-autotune", "reduce-overhead"]


def _config(mode: str, **opts: object) -> graphgear.CompilerConfig:
    cfg = graphgear.CompilerConfig()
    if mode == "eager":
        cfg.debug.run_eagerly = True
    else:
        cfg.mode = mode
    graphgear.config.apply_options(cfg, opts)
    return cfg


def _backend(mode: str, **opts: object) -> graphgear.GraphgearBackend:
    return graphgear.get_backend(compiler_config=_config(mode, **opts))


class _NoopOutputs(torch.nn.Module):
    """Returns ``x + 0``, ``self.w * 1`` and ``(x * 1).view(-1)``: removing the no-ops
    would hand back the input, the weight, and a view of the input."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x + 0, self.w * 1, (x * 1).view(-1), self.w.view(12) * 1


@pytest.mark.parametrize("mode", MODES)
def test_item6_noop_removal_never_aliases_outputs_to_inputs_or_weights(mode: str) -> None:
    model = _NoopOutputs()
    w_before = model.w.detach().clone()
    compiled = torch.compile(model, backend=_backend(mode))
    x = torch.randn(4, 3)
    x_before = x.clone()
    for _ in range(3):  # reduce-overhead: warm-up, capture, replay
        with torch.no_grad():
            outs = compiled(x)
            expected = model(x)
        assert_close(outs, expected)
        for i, out in enumerate(outs):
            for what, t in (("x", x), ("w", model.w)):
                assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr(), (
                    f"{mode}: output {i} shares memory with {what}"
                )
            out.mul_(0)
        torch.testing.assert_close(model.w.detach(), w_before)
        torch.testing.assert_close(x, x_before)


def test_item6_noop_removal_keeps_distinct_outputs_and_removes_the_rest() -> None:
    from graphgear.passes.noop import RemoveNoopOps

    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = x.relu()
        return a + 0, a * 1, (x + 0).relu()  # two outputs must not become one tensor

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(torch.randn(3))
    removed = RemoveNoopOps()(gm, [], _config("eager"))
    gm.recompile()
    x = torch.randn(3)
    outs = gm(x)
    assert_close(outs, f(x))
    assert outs[0].untyped_storage().data_ptr() != outs[1].untyped_storage().data_ptr()
    assert removed == 2  # one of a + 0 / a * 1, and the x + 0 under relu


def _kwarg_write_graph() -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """An aten graph whose KV-cache write passes the cache as a keyword: ``self=cache``."""

    def f(cache: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor]:
        aten.index_copy_.default(cache, 0, idx, v)
        return (v * 2,)

    args = [torch.zeros(6, 3), torch.tensor([1, 4]), torch.randn(2, 3)]
    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(*args)
    (node,) = [n for n in gm.graph.nodes if n.target is aten.index_copy_.default]
    names = [a.name for a in aten.index_copy_.default._schema.arguments]
    node.kwargs = dict(zip(names, node.args))
    node.args = ()
    gm.recompile()
    return gm, args


def test_item15_mutated_placeholders_reads_keyword_arguments() -> None:
    from graphgear.inputs import mutated_placeholders

    gm, _ = _kwarg_write_graph()
    assert mutated_placeholders(gm) == [0]

    # a keyword-only mutable argument: add.out(x, y, out=dst) writes dst
    g = fx.Graph()
    x, y, dst = g.placeholder("x"), g.placeholder("y"), g.placeholder("dst")
    g.output(g.call_function(aten.add.out, (x, y), {"out": dst}))
    assert mutated_placeholders(fx.GraphModule(torch.nn.Module(), g)) == [2]


def test_item15_keyword_cache_write_reaches_the_callers_tensor() -> None:
    # reduce-overhead copies inputs it does not know to be mutated into static buffers:
    # a missed mutation would write the buffer, not the caller's cache
    gm, args = _kwarg_write_graph()
    compiled = graphgear.get_compiler(_config("reduce-overhead"))(gm, args)
    for step in range(3):  # reduce-overhead: warm-up, capture, replay
        cache, idx, v = torch.zeros(6, 3), torch.tensor([step, 5 - step]), torch.randn(2, 3)
        expected_cache = cache.clone().index_copy_(0, idx, v)
        out = compiled(cache, idx, v)
        assert_close(out, (v * 2,))
        torch.testing.assert_close(cache, expected_cache, msg=lambda m, s=step: f"step {s}: {m}")


def test_item13_get_compiler_on_make_fx_graph_in_max_autotune() -> None:
    lin = torch.nn.Linear(8, 4)

    def f(x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.nn.functional.gelu(lin(x)),)

    x = torch.randn(3, 8)
    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(x)
    assert any(n.target is aten.t.default for n in gm.graph.nodes)  # what Inductor rejected
    compiled = graphgear.get_compiler(_config("max-autotune"))(gm, [x])
    for _ in range(2):
        x = torch.randn(3, 8)
        with torch.no_grad():
            assert_close(compiled(x), f(x))


class _LinearRelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


@pytest.mark.parametrize("mode", ["eager", "max-autotune"])
def test_item14_gears_land_on_the_user_input_after_lifted_parameters(mode: str) -> None:
    # a symbolic_trace graph keeps its parameters as attributes: AOTAutograd lifts them
    # to the front of the graph's inputs, so the geared x is the last input, not input 0
    model = _LinearRelu().eval()
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(4, 16)
    graphgear.set_dim_gears(x, {0: [2, 4]})
    compiled = graphgear.get_compiler(_config(mode))(gm, [x])
    with torch.no_grad():
        assert_close(compiled(x), model(x))
    (rec,) = [g for g in graphgear.stats().graphs if g.stage in ("forward", "inference")]
    assert rec.inputs[-1] == "x" and len(rec.inputs) == 3, rec.inputs

    # the gear is checked on x, and the error names it
    bad = torch.randn(3, 16)
    graphgear.set_dim_gears(bad, {0: [2, 4]})
    with pytest.raises(GearError, match=r"input 'x' has size 3 at dim 0.*\[2, 4\]"):
        graphgear.get_compiler(_config(mode))(torch.fx.symbolic_trace(model), [bad])


def test_item12_rotary_op_real_and_fake_strides_agree_on_transposed_inputs() -> None:
    from graphgear.passes.ops import rotary_rotate_half

    op = torch.ops.graphgear.rotary_rotate_half.default
    # q and k as HF models pass them: proj(x).view(B, S, H, D).transpose(1, 2)
    q = torch.randn(2, 5, 4, 8, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(2, 5, 2, 8, dtype=torch.float64).transpose(1, 2)
    cos = torch.randn(2, 1, 5, 8, dtype=torch.float64)
    sin = torch.randn(2, 1, 5, 8, dtype=torch.float64)
    for x in (q, k, q[..., :4]):  # also a sliced, non-contiguous last dim
        assert not x.is_contiguous()
        c, s = cos[..., : x.shape[-1]], sin[..., : x.shape[-1]]
        torch.library.opcheck(op, (x, c, s))  # fake vs real strides, AOT dispatch
        torch.library.opcheck(op, (x.detach().requires_grad_(True), c, s))
        out = rotary_rotate_half(x, c, s)
        with torch._subclasses.FakeTensorMode() as mode:
            fake = op(mode.from_tensor(x), mode.from_tensor(c), mode.from_tensor(s))
        assert out.stride() == fake.stride() and out.is_contiguous()
        half = x.shape[-1] // 2
        ref = x * c + torch.cat((-x[..., half:], x[..., :half]), -1) * s
        torch.testing.assert_close(out, ref)
        xg, cg, sg = (t.detach().clone().requires_grad_(True) for t in (x, c, s))
        torch.autograd.gradcheck(rotary_rotate_half, (xg, cg, sg))
        # the backward of a non-contiguous x
        xt = torch.randn(2, 5, 4, 8, dtype=torch.float64, requires_grad=True)
        rotary_rotate_half(xt.transpose(1, 2), cos, sin).sum().backward()
        xr = xt.detach().clone().requires_grad_(True)
        xv = xr.transpose(1, 2)
        (xv * cos + torch.cat((-xv[..., 4:], xv[..., :4]), -1) * sin).sum().backward()
        torch.testing.assert_close(xt.grad, xr.grad)


def _qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    return Qwen2ForCausalLM(cfg)


@pytest.mark.slow
def test_item12_qwen2_training_with_fx_passes_in_reduce_overhead() -> None:
    from tests.helpers import check_against_eager

    cfg = _config("reduce-overhead", fx_passes=True)
    fused: list[bool] = []

    def spy(gm: fx.GraphModule, example_inputs: object, config: object) -> None:
        fused.append(any(n.target is torch.ops.graphgear.rotary_rotate_half.default
                         for n in gm.graph.nodes))

    cfg.experimental_config.post_grad_custom_post_pass = spy
    model = _qwen2().train()
    check_against_eager(model, lambda: [torch.randint(0, 128, (2, 8))],
                        lambda m: torch.compile(m, backend=graphgear.get_backend(cfg)),
                        train=True, steps=3, loss_fn=lambda out: out.logits.square().mean())
    assert any(fused), "the rotary fusion did not fire: the test would not cover the op"


def _geared_rows(n: int) -> torch.Tensor:
    x = torch.randn(n, 3)
    graphgear.set_dim_gears(x, {0: [2, 4]})
    return x


@pytest.mark.parametrize("mode", MODES)
def test_item8_padding_refuses_outputs_sized_by_an_expression_of_the_gear(mode: str) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.relu(), torch.cat([x, x * 2])  # rows [x, 2x]: padding puts zeros mid-way

    def g(x: torch.Tensor) -> torch.Tensor:
        return (x + 1).reshape(-1)

    def h(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x @ w  # rows independent: dims of size s are sliced back, size 0 included
        return y, (y[:, None, :] * y[None, :, :]).sum(-1)  # (s, 3) and (s, s)

    cf = torch.compile(f, backend=_backend(mode, gear_padding=True))
    cg = torch.compile(g, backend=_backend(mode, gear_padding=True))
    ch = torch.compile(h, backend=_backend(mode, gear_padding=True))
    w = torch.randn(3, 3)
    for n in (4, 3, 0, 2, 1):
        x = _geared_rows(n)
        out = ch(x, w)
        assert [tuple(t.shape) for t in out] == [(n, 3), (n, n)]
        assert_close(out, h(x, w))
        if n in (2, 4):  # gears: no padding, exact results
            assert_close(cf(x), f(x))
            assert_close(cg(x), g(x))
            continue
        with pytest.raises(GearError) as e:
            cf(x)
        msg = str(e.value)
        assert "input 'x' dim 0" in msg and f"has size {n}, padded to gear" in msg, msg
        assert re.search(r"output 1 \(\w+\) has size 2\*s\d+ at dim 0", msg), msg
        assert "gear_padding = False" in msg and "[2, 4]" in msg, msg
        with pytest.raises(GearError, match=r"output 0 \(\w+\) has size 3\*s\d+ at dim 0"):
            cg(x)

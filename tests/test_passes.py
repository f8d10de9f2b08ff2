"""FX passes: the pass manager, the built-in post-grad passes, user passes and
replacements, and the joint-graph fusions (RMSNorm, rotary, attention) on the embedded
decoder and on transformers Llama and GPT-2.

Graphs run with ``debug.run_eagerly`` (no Inductor compile) so the tests stay fast;
``tests/test_max_autotune.py`` runs the same passes through Inductor.
"""

from __future__ import annotations

import copy
import glob
import os

import pytest
import torch
from torch import nn

import graphgear
from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder
from graphgear.passes import pass_names
from graphgear.passes import patterns as pattern_mod
from tests.helpers import assert_close

aten = torch.ops.aten


def eager_config(**experimental: object) -> graphgear.CompilerConfig:
    cfg = graphgear.CompilerConfig()
    cfg.mode = "reduce-overhead"
    cfg.debug.run_eagerly = True
    for k, v in experimental.items():
        setattr(cfg.experimental_config, k, v)
    return cfg


def last_record() -> graphgear.stats.GraphRecord:  # type: ignore[name-defined]
    return graphgear.stats().graphs[-1]


@pytest.fixture(autouse=True)
def _clean_log():
    graphgear.reset()
    torch._dynamo.reset()
    yield
    graphgear.reset()
    pattern_mod.clear_replacements()


@pytest.fixture
def rms_kernel(monkeypatch):
    """Pretend ``_fused_rms_norm`` has a kernel on the CPU (as on CUDA), so the RMSNorm
    rewrite is allowed to fire; the op then traces to its composite form here."""
    import graphgear.passes.joint as joint

    monkeypatch.setattr(joint, "fused_rms_norm_kernel", lambda device: True)


def run_decoder(cfg: graphgear.CompilerConfig, *, train: bool = False, layers: int = 2):
    torch.manual_seed(0)
    model = ToyDecoder(DecoderConfig(num_layers=layers))
    ref_model = copy.deepcopy(model)
    compiled = torch.compile(model, backend=graphgear.get_backend(cfg))
    tok, pos = torch.tensor([[3]]), torch.tensor([5])
    if train:
        out = compiled(tok, pos)
        ref = ref_model(tok, pos)
        out.square().sum().backward()
        ref.square().sum().backward()
        for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
            assert_close(p.grad, q.grad, reduction=4096, what=name)
    else:
        with torch.no_grad():
            out = compiled(tok, pos)
            ref = ref_model(tok, pos)
    assert_close(out, ref, reduction=512)
    for a, b in zip(model.layers, ref_model.layers):
        assert_close(a.attn.k_cache, b.attn.k_cache, reduction=512)
        assert_close(a.attn.v_cache, b.attn.v_cache, reduction=512)
    return model


# ---------------------------------------------------------------- pass manager


def test_pass_manager_order_timing_dump_and_switches(tmp_path):
    calls: list[str] = []

    def pre(gm, example_inputs, config):
        calls.append("pre")

    def post(gm, example_inputs, config):
        calls.append("post")

    cfg = eager_config(post_grad_custom_pre_pass=pre, post_grad_custom_post_pass=post)
    cfg.debug.graph_dump.type = "txt"
    cfg.debug.graph_dump.path = str(tmp_path)

    def f(x):
        return (x.view(4, 4) + 0).relu() * 1

    out = torch.compile(f, backend=graphgear.get_backend(cfg))(torch.randn(4, 4))
    assert out.shape == (4, 4)
    assert calls == ["pre", "post"]
    rec = last_record()
    assert rec.passes["remove_noop_ops"] >= 2, rec.passes  # view to the same shape, + 0, * 1
    assert "post_grad_custom_pre_pass" in rec.passes
    dumps = os.listdir(tmp_path)
    assert any(d.endswith("after_remove_noop_ops.txt") for d in dumps), dumps

    # switched off by its option, and by name
    torch._dynamo.reset()
    cfg2 = eager_config(remove_noop_ops=False)
    torch.compile(f, backend=graphgear.get_backend(cfg2))(torch.randn(4, 4))
    assert "remove_noop_ops" not in last_record().passes
    torch._dynamo.reset()
    cfg3 = eager_config(disabled_passes=("remove_noop_ops",))
    torch.compile(f, backend=graphgear.get_backend(cfg3))(torch.randn(4, 4))
    assert "remove_noop_ops" not in last_record().passes


def test_disabled_passes_unknown_name_is_an_error():
    cfg = eager_config(disabled_passes=("no_such_pass",))
    with pytest.raises(Exception) as info:
        torch.compile(lambda x: x + 1, backend=graphgear.get_backend(cfg))(torch.randn(3))
    text = str(info.value)
    assert "ValueError" in text or isinstance(info.value, ValueError)
    assert "no_such_pass" in text and "remove_noop_ops" in text
    with pytest.raises(ValueError, match="disabled_passes"):
        graphgear.CompilerConfig().experimental_config.disabled_passes = "remove_noop_ops"


def test_pass_names_lists_every_builtin_pass():
    names = pass_names()
    for n in ("rms_norm_fusion", "rotary_fusion", "attention_fusion", "remove_noop_ops",
              "pattern_fusion", "fold_repeat_kv", "reinplace_inputs", "view_to_reshape"):
        assert n in names


# ---------------------------------------------------------------- register_replacement


def _search(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x) - torch.relu(-x)


def _replace(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def test_register_replacement_fires_and_keeps_numerics():
    graphgear.register_replacement(_search, _replace, [torch.randn(8)])
    seen: list[set] = []

    def spy(gm, example_inputs, config):
        seen.append({n.target for n in gm.graph.nodes if n.op == "call_function"})

    cfg = eager_config(post_grad_custom_post_pass=spy)

    def f(x, y):
        return (torch.relu(x) - torch.relu(-x)) * y

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    out = torch.compile(f, backend=graphgear.get_backend(cfg))(x, y)
    assert_close(out, f(x, y), reduction=8)
    assert last_record().passes["pattern_fusion"] == 1
    assert aten.relu.default not in seen[-1]


def test_register_replacement_does_not_fire_on_other_pattern_or_when_off():
    graphgear.register_replacement(_search, _replace, [torch.randn(8)])

    def g(x, y):  # relu(x) - relu(-y): not the pattern
        return torch.relu(x) - torch.relu(-y)

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    out = torch.compile(g, backend=graphgear.get_backend(eager_config()))(x, y)
    assert_close(out, g(x, y), reduction=8)
    assert last_record().passes.get("pattern_fusion", 0) == 0

    torch._dynamo.reset()

    def f(x):
        return torch.relu(x) - torch.relu(-x)

    torch.compile(f, backend=graphgear.get_backend(eager_config(pattern_fusion_pass=False)))(x)
    assert "pattern_fusion" not in last_record().passes


def test_register_replacement_rejects_bad_input():
    with pytest.raises(TypeError, match="callables"):
        graphgear.register_replacement(_search, None, [torch.randn(3)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="takes 1 arguments but 2"):
        graphgear.register_replacement(_search, _replace, [torch.randn(3), torch.randn(3)])


# ---------------------------------------------------------------- in-place recovery


class Cache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 6, 3))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        c = self.cache[: x.shape[0]]
        c.index_copy_(1, pos, x)
        return c.sum(1)


def test_reinplace_writes_cache_in_place():
    final: list[list] = []

    def spy(gm, example_inputs, config):
        final.append([n.target for n in gm.graph.nodes if n.op == "call_function"])

    m = Cache()
    ref = Cache()
    f = torch.compile(m, backend=graphgear.get_backend(eager_config(post_grad_custom_post_pass=spy)))
    x, pos = torch.randn(2, 1, 3), torch.tensor([4])
    with torch.no_grad():
        out = f(x, pos)
        expected = ref(x, pos)
    assert_close(out, expected, reduction=6)
    assert_close(m.cache, ref.cache)
    assert last_record().passes["reinplace_inputs"] == 1
    targets = final[-1]
    assert aten.index_copy_.default in targets
    assert aten.copy_.default not in targets and aten.slice_scatter.default not in targets


class SelectWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache[1] = x  # select_scatter: no in-place op to recover
        return self.cache * 2


def test_reinplace_leaves_other_writes_alone():
    m, ref = SelectWrite(), SelectWrite()
    f = torch.compile(m, backend=graphgear.get_backend(eager_config()))
    x = torch.randn(3)
    with torch.no_grad():
        assert_close(f(x), ref(x))
    assert_close(m.cache, ref.cache)
    assert last_record().passes.get("reinplace_inputs", 0) == 0


def test_reinplace_switch():
    m = Cache()
    f = torch.compile(m, backend=graphgear.get_backend(eager_config(disabled_passes=["reinplace_inputs"])))
    with torch.no_grad():
        f(torch.randn(2, 1, 3), torch.tensor([4]))
    assert "reinplace_inputs" not in last_record().passes


# ---------------------------------------------------------------- joint fusions, embedded decoder


def test_fusions_fire_on_decoder_inference_and_match_eager(rms_kernel):
    run_decoder(eager_config(fx_passes=True))
    (entry,) = graphgear.stats().joint
    assert not entry["training"]
    # 2 layers: 2 norms each + the final norm; rotary on q and k; one attention per layer
    assert entry["matches"]["rms_norm_fusion"] == 5
    assert entry["matches"]["rotary_fusion"] == 4
    assert entry["matches"]["attention_fusion"] == 2
    assert entry["nodes_after"] < entry["nodes_before"] - 40, entry
    rec = last_record()
    # the fused SDPA output is reshaped, not viewed, and the KV cache is written in place
    assert rec.passes["view_to_reshape"] >= 1
    assert rec.passes["reinplace_inputs"] == 4  # 2 layers x (k, v)


def test_no_sdpa_on_cpu_where_inductor_generates_the_code():
    cfg = graphgear.CompilerConfig()
    cfg.mode = "reduce-overhead"
    cfg.experimental_config.fx_passes = True
    run_decoder(cfg)
    (entry,) = graphgear.stats().joint
    assert entry["matches"]["attention_fusion"] == 0
    assert entry["matches"]["rotary_fusion"] == 4


def test_no_rms_norm_rewrite_without_a_fused_kernel():
    from graphgear.passes.joint import fused_rms_norm_kernel

    assert not fused_rms_norm_kernel(torch.device("cpu"))  # CompositeImplicit on the CPU
    run_decoder(eager_config(fx_passes=True))
    (entry,) = graphgear.stats().joint
    assert entry["matches"]["rms_norm_fusion"] == 0
    assert entry["matches"]["rotary_fusion"] == 4 and entry["matches"]["attention_fusion"] == 2


def test_fusions_off_by_default():
    run_decoder(eager_config())
    assert graphgear.stats().joint == []


def test_each_fusion_switchable_by_name(rms_kernel):
    run_decoder(eager_config(fx_passes=True, disabled_passes=("attention_fusion", "rotary_fusion")))
    (entry,) = graphgear.stats().joint
    assert entry["matches"]["rms_norm_fusion"] == 5
    assert "attention_fusion" not in entry["matches"] and "rotary_fusion" not in entry["matches"]


def test_fusions_in_training_keep_gradients():
    run_decoder(eager_config(fx_passes=True), train=True)
    (entry,) = graphgear.stats().joint
    assert entry["training"] and entry["pre_grad"]  # fused before differentiation
    assert entry["matches"]["rotary_fusion"] == 4
    assert entry["matches"]["attention_fusion"] == 2
    assert entry["matches"]["rms_norm_fusion"] == 0  # no fused kernel on the CPU


def test_fusions_in_training_rms_norm_with_a_fused_kernel(rms_kernel):
    run_decoder(eager_config(fx_passes=True), train=True)
    (entry,) = graphgear.stats().joint
    assert entry["training"]
    assert entry["matches"] == {"joint_remove_noops": entry["matches"]["joint_remove_noops"],
                                "rms_norm_fusion": 5, "rotary_fusion": 4, "attention_fusion": 2}


def test_joint_passes_dump_after_each_fusion(tmp_path, rms_kernel):
    cfg = eager_config(fx_passes=True)
    cfg.debug.graph_dump.type = "py"
    cfg.debug.graph_dump.path = str(tmp_path)
    run_decoder(cfg, layers=1)
    names = os.listdir(tmp_path)
    for p in ("rms_norm_fusion", "rotary_fusion", "attention_fusion"):
        assert any(n.endswith(f"joint_after_{p}.py") for n in names), names
    text = open(glob.glob(str(tmp_path / "*joint_after_attention_fusion.py"))[0]).read()
    assert "scaled_dot_product_attention" in text


# ---------------------------------------------------------------- negatives


class Block(nn.Module):
    """Variants of the three patterns that must NOT be rewritten."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.w = nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.variant == "pow3":  # not a mean of squares
            n = self.w * (x * torch.rsqrt(x.pow(3).mean(-1, keepdim=True) + 1e-6))
        else:  # mean over the wrong dim
            n = self.w * (x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6))
        h = q.shape[-1] // 2
        rot = q * cos + torch.cat((q[..., h:], -q[..., :h]), dim=-1) * sin  # rotate the other way
        s = torch.matmul(q, k.transpose(2, 3)) * 0.25
        attn = torch.matmul(torch.softmax(s, dim=-2), v)  # softmax over the wrong dim
        return n, rot, attn


@pytest.mark.parametrize("variant", ["pow3", "dim0"])
def test_fusions_do_not_fire_where_the_pattern_differs(variant, rms_kernel):
    m = Block(variant)
    args = (torch.randn(3, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16),
            torch.randn(1, 2, 4, 16), torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16))
    f = torch.compile(m, backend=graphgear.get_backend(eager_config(fx_passes=True)))
    with torch.no_grad():
        out, ref = f(*args), m(*args)
    for a, b in zip(out, ref):
        assert_close(a, b, reduction=16)
    (entry,) = graphgear.stats().joint
    assert entry["matches"]["rms_norm_fusion"] == 0
    assert entry["matches"]["rotary_fusion"] == 0
    assert entry["matches"]["attention_fusion"] == 0


def _rotary_and_attention(x, q, k, v, cos, sin):
    h = x.shape[-1] // 2
    rot = x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin
    attn = torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.25, dim=-1), v)
    return rot.sum() + attn.square().sum()


def _biased_attention(x, w, b, k, v, cos, sin):
    q = torch.nn.functional.linear(x, w, b).transpose(1, 2)  # (batch, seq, heads, 8) -> heads first
    return _rotary_and_attention(q, q, k, v, cos, sin)


def test_training_with_dynamic_shapes_is_fused_before_differentiation():
    """Symbolic sizes: the forward is traced with them and fused before AOTAutograd,
    attention included, without specialising the dynamic batch (a biased linear on a 4-D
    input did, through functionalization: the batch dim is marked dynamic, so dynamo
    would raise); one graph serves another batch size, gradients equal eager."""

    f = _biased_attention
    cf = torch.compile(f, backend=graphgear.get_backend(eager_config(fx_passes=True)))
    for batch in (2, 3):
        g = torch.Generator().manual_seed(batch)
        x = torch.randn(batch, 6, 4, 8, generator=g, requires_grad=True)
        w = torch.randn(8, 8, generator=g, requires_grad=True)
        b = torch.randn(8, generator=g, requires_grad=True)
        k, v = (torch.randn(batch, 4, 6, 8, generator=g, requires_grad=True) for _ in range(2))
        cos, sin = torch.randn(1, 1, 6, 8, generator=g), torch.randn(1, 1, 6, 8, generator=g)
        leaves = (x, w, b, k, v)
        if batch == 2:
            for t in (x, k, v):
                torch._dynamo.mark_dynamic(t, 0)
        cf(x, w, b, k, v, cos, sin).backward()
        grads = [t.grad for t in leaves]
        for t in leaves:
            t.grad = None
        f(x, w, b, k, v, cos, sin).backward()
        for got, t in zip(grads, leaves):
            assert_close(got, t.grad, reduction=64)
    (entry,) = graphgear.stats().joint  # batch 3 ran the same graph
    assert entry["training"] and entry["pre_grad"]
    assert entry["matches"]["rotary_fusion"] == 1 and entry["matches"]["attention_fusion"] == 1


def test_training_with_dynamic_shapes_and_a_buffer_write_uses_the_joint_graph():
    """A symbolic graph that writes a buffer is traced without functionalization, so it
    is left to the joint passes (as the toy decoder's KV cache in training)."""
    run_decoder_dynamic = ToyDecoder(DecoderConfig(num_layers=1))
    ref = copy.deepcopy(run_decoder_dynamic)
    cf = torch.compile(run_decoder_dynamic, backend=graphgear.get_backend(eager_config(fx_passes=True)))
    tok, pos = torch.tensor([[3], [4]]), torch.tensor([5])
    torch._dynamo.mark_dynamic(tok, 0)
    cf(tok, pos).square().sum().backward()
    ref(tok, pos).square().sum().backward()
    for (name, p), (_, q) in zip(run_decoder_dynamic.named_parameters(), ref.named_parameters()):
        assert_close(p.grad, q.grad, reduction=4096, what=name)
    (entry,) = graphgear.stats().joint
    assert entry["training"] and not entry["pre_grad"]
    assert entry["matches"]["rotary_fusion"] == 2


def test_joint_graph_fallback_never_rewrites_a_differentiated_attention(monkeypatch):
    """Where the pre-grad trace fails, the fusions run on the joint graph: rotary by its
    traced forward+backward pattern; an attention whose backward reads its
    intermediates is left alone. Gradients equal eager either way."""
    import graphgear.passes.joint as joint

    def failing_make_fx(*args, **kwargs):
        raise RuntimeError("simulated pre-grad trace failure")

    monkeypatch.setattr(joint, "make_fx", failing_make_fx)
    cf = torch.compile(_rotary_and_attention, backend=graphgear.get_backend(eager_config(fx_passes=True)))
    args = [torch.randn(2, 4, 6, 8, requires_grad=True) for _ in range(4)]
    args += [torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)]
    cf(*args).backward()
    grads = [t.grad for t in args[:4]]
    for t in args[:4]:
        t.grad = None
    _rotary_and_attention(*args).backward()
    for g, t in zip(grads, args[:4]):
        assert_close(g, t.grad, reduction=8)
    (entry,) = graphgear.stats().joint
    assert entry["training"] and not entry["pre_grad"], entry
    assert entry["matches"]["rotary_fusion"] == 1
    assert entry["matches"]["attention_fusion"] == 0


@pytest.mark.parametrize("variant", ["pow3", "dim0"])
def test_fusions_do_not_fire_where_the_pattern_differs_in_training(variant, rms_kernel):
    from tests.helpers import check_against_eager

    def inputs():
        g = torch.Generator().manual_seed(1)
        x = (torch.rand(3, 16, generator=g) + 0.5).requires_grad_()  # pow3: mean stays > 0
        return (x,
                *(torch.randn(1, 2, 4, 16, generator=g, requires_grad=True) for _ in range(3)),
                torch.randn(1, 1, 4, 16, generator=g), torch.randn(1, 1, 4, 16, generator=g))

    cfg = eager_config(fx_passes=True)
    check_against_eager(Block(variant), inputs,
                        lambda m: torch.compile(m, backend=graphgear.get_backend(cfg)),
                        train=True, steps=1)
    (entry,) = [e for e in graphgear.stats().joint if e["training"]][:1]
    assert entry["matches"]["rms_norm_fusion"] == 0
    assert entry["matches"]["rotary_fusion"] == 0
    assert entry["matches"]["attention_fusion"] == 0


def test_attention_with_bool_mask_is_not_rewritten():
    def f(q, k, v, mask):
        s = torch.matmul(q, k.transpose(-2, -1)) * 0.25
        s = s.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(s, dim=-1), v)

    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    out = torch.compile(f, backend=graphgear.get_backend(eager_config(fx_passes=True)))(q, k, v, mask)
    assert_close(out, f(q, k, v, mask), reduction=8)
    assert graphgear.stats().joint[-1]["matches"]["attention_fusion"] == 0


# ---------------------------------------------------------------- the attention matcher, by layout


def _attention_case(layout: str, dtype: torch.dtype):
    g = torch.Generator().manual_seed(3)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    mask = r(2, 1, 6, 6)
    if layout == "contiguous":
        args = (r(2, 4, 6, 8), r(2, 4, 6, 8), r(2, 4, 6, 8), mask)

        def f(q, k, v, mask):
            return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.3 + mask, -1), v)
    elif layout == "transposed_q":  # q as projections give it: (b, s, h, d).transpose(1, 2)
        args = (r(2, 6, 4, 8), r(2, 4, 6, 8), r(2, 6, 4, 8))

        def f(q, k, v):
            q, v = q.transpose(1, 2), v.transpose(1, 2)
            return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(2, 3)) / 2.5, dim=-1), v)
    elif layout == "repeat_kv":  # grouped keys and values, expanded to the heads
        args = (r(2, 4, 6, 8), r(2, 2, 6, 8), r(2, 2, 6, 8), mask)

        def f(q, k, v, mask):
            k = k[:, :, None].expand(2, 2, 2, 6, 8).reshape(2, 4, 6, 8)
            v = v[:, :, None].expand(2, 2, 2, 6, 8).reshape(2, 4, 6, 8)
            return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(2, 3)) * 0.3 + mask, -1), v)
    else:  # k^T written as a permute
        args = (r(2, 4, 6, 8), r(2, 4, 6, 8), r(2, 4, 6, 8))

        def f(q, k, v):
            return torch.matmul(torch.softmax(torch.matmul(q, k.permute(0, 1, 3, 2)) * 0.3, -1), v)
    return f, args


@pytest.mark.parametrize("decomposed", [False, True], ids=["aten", "inductor-decomposed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed_q", "repeat_kv", "permute"])
def test_attention_matcher_every_layout(layout, dtype, decomposed):
    """One matcher for every matmul layout, on aten graphs and on graphs made with
    Inductor's decompositions (softmax as amax/exp/sum/div, half cast to float32)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphgear._torch.inductor_passes import inductor_decomp_table
    from graphgear.passes.attention import fuse_attention

    f, args = _attention_case(layout, dtype)
    table = inductor_decomp_table() if decomposed else None
    gm = make_fx(f, decomposition_table=table, tracing_mode="fake")(*args)
    gm.graph.eliminate_dead_code()
    assert fuse_attention(gm, decompositions=table) == 1
    gm.recompile()
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert not targets & {aten._softmax.default, aten.amax.default, aten.exp.default, aten.bmm.default}
    assert_close(gm(*args), f(*args), reduction=8)


@pytest.mark.parametrize("decomposed", [False, True], ids=["aten", "inductor-decomposed"])
def test_attention_matcher_refuses_other_softmax_dims_and_shared_scores(decomposed):
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphgear._torch.inductor_passes import inductor_decomp_table
    from graphgear.passes.attention import fuse_attention

    def wrong_dim(q, k, v):
        return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-2, -1)) * 0.3, dim=-2), v)

    def scores_read_twice(q, k, v):
        s = torch.matmul(q, k.transpose(-2, -1)) * 0.3
        return torch.matmul(torch.softmax(s, dim=-1), v), s.sum()

    args = tuple(torch.randn(2, 4, 6, 6) for _ in range(3))
    table = inductor_decomp_table() if decomposed else None
    for f in (wrong_dim, scores_read_twice):
        gm = make_fx(f, decomposition_table=table, tracing_mode="fake")(*args)
        assert fuse_attention(gm, decompositions=table) == 0, f.__name__


# ---------------------------------------------------------------- fused ops


def test_rotary_op_matches_formula_and_gradients():
    from graphgear.passes.ops import rotary_rotate_half

    x = torch.randn(2, 4, 5, 8, dtype=torch.float64, requires_grad=True)
    cos = torch.randn(1, 1, 5, 8, dtype=torch.float64, requires_grad=True)
    sin = torch.randn(1, 1, 5, 8, dtype=torch.float64, requires_grad=True)
    ref = x * cos + torch.cat((-x[..., 4:], x[..., :4]), -1) * sin
    assert_close(rotary_rotate_half(x, cos, sin), ref)
    torch.autograd.gradcheck(rotary_rotate_half, (x, cos, sin))
    torch.library.opcheck(torch.ops.graphgear.rotary_rotate_half.default,
                          (x.detach(), cos.detach(), sin.detach()))
    with pytest.raises(ValueError, match="even"):
        rotary_rotate_half(torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 5))


# ---------------------------------------------------------------- transformers models


def _llama(attn: str = "eager"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      attn_implementation=attn)
    return LlamaForCausalLM(cfg)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, attn_implementation="eager",
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _run_hf(model: nn.Module, cfg: graphgear.CompilerConfig, train: bool) -> None:
    ref = copy.deepcopy(model)
    model.train(train)
    ref.train(train)
    f = torch.compile(model, backend=graphgear.get_backend(cfg))
    ids = torch.randint(0, 128, (2, 8))
    if train:
        out, expected = f(ids).logits, ref(ids).logits
        out.square().mean().backward()
        expected.square().mean().backward()
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert_close(p.grad, q.grad, reduction=8192, what=name)
    else:
        with torch.no_grad():
            out, expected = f(ids).logits, ref(ids).logits
    assert_close(out, expected, reduction=1024)


@pytest.mark.slow
def test_llama_inference_fusions(rms_kernel):
    _run_hf(_llama(), eager_config(fx_passes=True), train=False)
    (entry,) = graphgear.stats().joint
    assert entry["matches"]["rms_norm_fusion"] == 5
    assert entry["matches"]["rotary_fusion"] == 4
    assert entry["matches"]["attention_fusion"] == 2
    assert entry["nodes_after"] < entry["nodes_before"]
    print(f"llama inference: {entry['matches']} nodes {entry['nodes_before']} -> {entry['nodes_after']}")


@pytest.mark.slow
def test_gpt2_inference_fusions():
    _run_hf(_gpt2(), eager_config(fx_passes=True), train=False)
    (entry,) = graphgear.stats().joint
    # no RMSNorm (LayerNorm) and no rotary in GPT-2: nothing to rewrite there
    assert entry["matches"]["rms_norm_fusion"] == 0
    assert entry["matches"]["rotary_fusion"] == 0
    assert entry["matches"]["attention_fusion"] == 2
    print(f"gpt2 inference: {entry['matches']} nodes {entry['nodes_before']} -> {entry['nodes_after']}")


def _hf_train_check(model: nn.Module, cfg: graphgear.CompilerConfig) -> list[set]:
    """Two training steps against eager (outputs, every gradient); returns the op targets
    of each compiled graph (forward, backward) after the passes."""
    from tests.helpers import check_against_eager

    seen: list[set] = []

    def spy(gm, example_inputs, config):
        seen.append({n.target for n in gm.graph.nodes if n.op == "call_function"})

    cfg.experimental_config.post_grad_custom_post_pass = spy
    model.train()
    check_against_eager(model, lambda: [torch.randint(0, 128, (2, 8))],
                        lambda m: torch.compile(m, backend=graphgear.get_backend(cfg)),
                        train=True, loss_fn=lambda out: out.logits.square().mean())
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_hf_training_with_fusions_keeps_gradients(which, rms_kernel):
    model = _llama() if which == "llama" else _gpt2()
    seen = _hf_train_check(model, eager_config(fx_passes=True))
    (entry,) = graphgear.stats().joint
    assert entry["training"] and entry["pre_grad"]
    m = entry["matches"]
    if which == "llama":
        assert (m["rms_norm_fusion"], m["rotary_fusion"], m["attention_fusion"]) == (5, 4, 2), m
        assert any(torch.ops.graphgear.rotary_rotate_half.default in s for s in seen)
    else:
        assert (m["rms_norm_fusion"], m["rotary_fusion"], m["attention_fusion"]) == (0, 0, 2), m
    # the forward and the backward run the fused attention, not softmax
    assert len(seen) == 2
    for targets in seen:
        assert aten._softmax.default not in targets and aten._softmax_backward_data.default not in targets
    print(f"{which} training: {m} nodes {entry['nodes_before']} -> {entry['nodes_after']}")


@pytest.mark.slow
@pytest.mark.parametrize("which", ["llama", "gpt2"])
def test_hf_training_with_fusions_max_autotune(which, rms_kernel):
    cfg = graphgear.CompilerConfig()
    cfg.experimental_config.fx_passes = True
    model = _llama() if which == "llama" else _gpt2()
    _hf_train_check(model, cfg)
    (entry,) = graphgear.stats().joint
    m = entry["matches"]
    # attention stays Inductor's on the CPU (measured faster than the SDPA kernel there)
    if which == "llama":
        assert (m["rms_norm_fusion"], m["rotary_fusion"], m["attention_fusion"]) == (5, 4, 0), m
    else:
        assert (m["rms_norm_fusion"], m["rotary_fusion"], m["attention_fusion"]) == (0, 0, 0), m


# ---------------------------------------------------------------- fold_repeat_kv


class _GQA(nn.Module):
    """transformers' decode attention: write the new key/value into a static cache,
    ``repeat_kv`` the cache to the query heads, SDPA with a boolean mask."""

    def __init__(self, batch: int, heads: int = 4, kv_heads: int = 2, length: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.rep = heads // kv_heads
        self.register_buffer("k_cache", torch.zeros(batch, kv_heads, length, dim))
        self.register_buffer("v_cache", torch.zeros(batch, kv_heads, length, dim))
        self.q = nn.Linear(dim, heads * dim)
        self.heads, self.dim = heads, dim

    @staticmethod
    def repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
        b, h, n, d = x.shape
        return x[:, :, None, :, :].expand(b, h, rep, n, d).reshape(b, h * rep, n, d)

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q = self.q(x).view(b, 1, self.heads, self.dim).transpose(1, 2)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        mask = (torch.arange(self.k_cache.shape[2]) <= pos)[None, None, None, :].expand(b, 1, 1, -1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, self.repeat_kv(self.k_cache, self.rep), self.repeat_kv(self.v_cache, self.rep), attn_mask=mask)
        return out.transpose(1, 2).reshape(b, 1, -1)


@pytest.mark.parametrize("mode", ["eager", "reduce-overhead", "max-autotune"])
def test_fold_repeat_kv_and_decode_attention_in_inference_equal_eager(mode):
    """The CPU attention reads the unexpanded KV cache (fold_repeat_kv fires once per
    attention); where Inductor compiles (not in eager mode) the one-query attention,
    grouped heads and a boolean mask over a static cache, is then written out for it
    (decode_attention); every step's output and cache write equal eager's."""
    torch.manual_seed(0)
    model = _GQA(batch=3)
    ref = copy.deepcopy(model)
    cfg = eager_config() if mode == "eager" else graphgear.CompilerConfig()
    if mode != "eager":
        cfg.mode = mode
    f = torch.compile(model, backend=graphgear.get_backend(cfg))
    with torch.no_grad():
        for p in range(4):
            x, k, v = torch.randn(3, 1, 8), torch.randn(3, 2, 1, 8), torch.randn(3, 2, 1, 8)
            pos = torch.tensor([p])
            assert_close(f(x, k, v, pos), ref(x, k, v, pos), reduction=16)
    assert_close(model.k_cache, ref.k_cache, reduction=1)
    assert_close(model.v_cache, ref.v_cache, reduction=1)
    assert last_record().passes.get("fold_repeat_kv") == 1
    assert last_record().passes.get("decode_attention", 0) == (0 if mode == "eager" else 1)


def test_fold_repeat_kv_leaves_training_and_other_layouts_alone():
    """A training forward saves the attention's log-sum-exp for the backward (which
    reads the expanded tensors): not rewritten, gradients equal eager's. A repeat along
    another dim is not ``repeat_kv``: not rewritten."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, requires_grad=True) for _ in range(3))
    kv_k, kv_v = (torch.randn(2, 2, 5, 8, requires_grad=True) for _ in range(2))

    def fn(q, kv_k, kv_v):
        return torch.nn.functional.scaled_dot_product_attention(
            q, _GQA.repeat_kv(kv_k, 2), _GQA.repeat_kv(kv_v, 2)).sum()

    f = torch.compile(fn, backend=graphgear.get_backend(eager_config()))
    got = torch.autograd.grad(f(q, kv_k, kv_v), (q, kv_k, kv_v))
    want = torch.autograd.grad(fn(q, kv_k, kv_v), (q, kv_k, kv_v))
    for a, b in zip(got, want):
        assert_close(a, b, reduction=40)
    assert all(r.passes.get("fold_repeat_kv", 0) == 0 for r in graphgear.stats().graphs)

    graphgear.reset()
    torch._dynamo.reset()

    def other(q, kv):  # repeats whole positions (dim 3), not heads
        b, h, n, d = kv.shape
        rep = kv[:, :, :, None, :].expand(b, h, n, 2, d).reshape(b, h, n * 2, d)
        return torch.nn.functional.scaled_dot_product_attention(q, rep, rep)

    g = torch.compile(other, backend=graphgear.get_backend(eager_config()))
    with torch.no_grad():
        qq, kv = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 5, 8)
        assert_close(g(qq, kv), other(qq, kv), reduction=10)
    assert last_record().passes.get("fold_repeat_kv", 0) == 0


def test_fold_repeat_kv_on_a_dynamic_batch_adds_no_guard():
    """Symbolic batch and length: the pass compares sizes without specialising them (one
    graph serves every size) and still fires."""
    def fn(q, kv_k, kv_v):
        return torch.nn.functional.scaled_dot_product_attention(
            q, _GQA.repeat_kv(kv_k, 2), _GQA.repeat_kv(kv_v, 2))

    f = torch.compile(fn, backend=graphgear.get_backend(eager_config()), dynamic=True)
    with torch.no_grad():
        for b, n in [(3, 5), (6, 7), (5, 4)]:  # no size equal to the 2 KV heads (duck sizing)
            q, k, v = torch.randn(b, 4, 1, 8), torch.randn(b, 2, n, 8), torch.randn(b, 2, n, 8)
            assert_close(f(q, k, v), fn(q, k, v), reduction=n)
    recs = graphgear.stats().graphs
    assert len(recs) == 1 and recs[0].passes.get("fold_repeat_kv") == 1


# ---------------------------------------------------------------- decode_attention


def _flash(q, k, v, mask, scale=None):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)[0]


def _without_attention_kernel(monkeypatch) -> None:
    """As where graphgear's decode attention kernel cannot be built: the pass writes the
    attention out instead."""
    import graphgear.cpu.kernels.decode_attention_kernel as attention_kernel

    monkeypatch.setattr(attention_kernel, "kernel", lambda: None)


@pytest.mark.parametrize("mask_heads", [1, 6], ids=["shared-mask", "per-head-bias"])
@pytest.mark.parametrize("dtype,path", [(torch.float32, "kernel"), (torch.float32, "written-out"),
                                        (torch.bfloat16, "written-out")])
def test_decode_attention_matches_the_flash_kernel_masked_rows_and_scale(dtype, path, mask_heads, monkeypatch):
    """Against the kernel it replaces, by graphgear's kernel (float32) and written out
    (bfloat16 always, computed in float32; float32 where the kernel is not built): a
    float mask (shared by the heads, or an additive bias per query head: head order
    across the key/value groups) with a fully masked batch row (zeros, not NaN), a
    custom scale, grouped heads."""
    if path == "written-out":
        _without_attention_kernel(monkeypatch)
    torch.manual_seed(0)
    q = torch.randn(3, 6, 1, 16, dtype=dtype)
    k, v = torch.randn(3, 2, 20, 16, dtype=dtype), torch.randn(3, 2, 20, 16, dtype=dtype)
    mask = torch.zeros(3, mask_heads, 1, 20, dtype=dtype)
    if mask_heads > 1:
        mask += torch.randn(3, mask_heads, 1, 20).to(dtype)
    mask[0, ..., 7:] = float("-inf")
    mask[1] = float("-inf")  # batch row 1 sees no key

    def fn(q, k, v, mask):
        return _flash(q, k, v, mask, scale=0.3) * 2

    cfg = graphgear.CompilerConfig()
    cfg.mode = "reduce-overhead"
    f = torch.compile(fn, backend=graphgear.get_backend(cfg))
    with torch.no_grad():
        want = fn(q, k, v, mask)
        for _ in range(3):
            got = f(q, k, v, mask)
            assert not got.isnan().any()
            if dtype == torch.float32:
                assert_close(got, want, reduction=20)
            else:  # within 2 bfloat16 units in the last place of the flash kernel's result
                torch.testing.assert_close(got.float(), want.float(), atol=1.6e-2, rtol=1.6e-2)
    assert bool((got[1] == 0).all())
    assert last_record().passes.get("decode_attention") == 1


def test_decode_attention_stores_the_query_once_for_every_key(monkeypatch):
    """The written-out product-sum reads the query once per key. Left a pointwise value,
    Inductor would inline it there and recompute it, a rotary embedding's sines and
    cosines included, for every key (256 keys at batch 4 was 1.22x slower than the flash
    kernel): the pass marks the query stored (Inductor's force-stride-order prim, a no-op
    in eager mode), and the result still equals the flash kernel's. (The written-out
    form: where graphgear's kernel is not built.)"""
    from torch.fx.experimental.proxy_tensor import make_fx

    _without_attention_kernel(monkeypatch)
    from graphgear.passes.decode_attention import DecodeAttention

    def fn(x, pos, k, v, mask):
        angle = pos[:, None, None, None].float() * torch.arange(1, 9).float()
        q = x * torch.cos(angle) + x.flip(-1) * torch.sin(angle)  # a rotary-style query
        return (_flash(q, k, v, mask),)

    torch.manual_seed(0)
    args = (torch.randn(2, 4, 1, 8), torch.tensor([3, 5]), torch.randn(2, 2, 10, 8),
            torch.randn(2, 2, 10, 8), torch.zeros(2, 1, 1, 10))
    gm = make_fx(fn, tracing_mode="fake")(*args)
    gm.graph.eliminate_dead_code()
    cfg = graphgear.CompilerConfig()
    cfg.mode = "reduce-overhead"
    assert DecodeAttention()(gm, args, cfg) == 1
    gm.recompile()
    stored = [n for n in gm.graph.nodes if n.op == "call_function"
              and n.target is torch.ops.prims.inductor_force_stride_order.default]
    assert len(stored) == 1
    assert tuple(stored[0].meta["val"].shape) == (2, 2, 2, 1, 8)  # the grouped query
    assert_close(gm(*args)[0], fn(*args)[0], reduction=10)


def test_decode_attention_leaves_long_contexts_causal_and_training_alone(monkeypatch):
    """Past MAX_MACS (long contexts: the flash kernel's blocked products win) the
    attention is not written out, with is_causal and where the log-sum-exp is used (a
    training forward) not rewritten at all; graphgear's kernel takes the long context
    (it is faster than the flash kernel at every size measured). Results and gradients
    equal eager's."""
    from graphgear.passes.decode_attention import MAX_MACS

    cfg = graphgear.CompilerConfig()
    cfg.mode = "max-autotune"
    length = MAX_MACS // (2 * 4 * 8) + 1  # batch 2, 4 heads of 8: one key past the limit
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 4, length, 8), torch.randn(2, 4, length, 8)

    def long(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    def causal(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    # with graphgear's kernel, without it (as where it cannot be built)
    for kernel, fn, args, rewritten in [(True, long, (q, k, v), 1), (True, causal, (q, k[:, :, :5], v[:, :, :5]), 0),
                                        (False, long, (q, k, v), 0)]:
        with monkeypatch.context() as m:
            if not kernel:
                _without_attention_kernel(m)
            graphgear.reset()
            torch._dynamo.reset()
            f = torch.compile(fn, backend=graphgear.get_backend(cfg))
            with torch.no_grad():
                assert_close(f(*args), fn(*args), reduction=64)
            assert last_record().passes.get("decode_attention", 0) == rewritten, (kernel, fn.__name__)
    graphgear.reset()
    torch._dynamo.reset()
    qt, kt, vt = (torch.randn(2, 4, 1, 8, requires_grad=True) for _ in range(3))
    f = torch.compile(long, backend=graphgear.get_backend(cfg))
    got = torch.autograd.grad(f(qt, kt, vt).sum(), (qt, kt, vt))
    want = torch.autograd.grad(long(qt, kt, vt).sum(), (qt, kt, vt))
    for a, b in zip(got, want):
        assert_close(a, b, reduction=8)
    assert all(r.passes.get("decode_attention", 0) == 0 for r in graphgear.stats().graphs)

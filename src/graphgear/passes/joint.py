"""Joint-graph fusion passes (``experimental_config.fx_passes``).

Run on the inference graph (no grad) and on training graphs. Each rewrites a pattern
models write by hand into one fused op, only where the fused op computes what the
pattern computes:

* ``rms_norm_fusion``: ``w * (x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))`` (either
  order of the outer product) → ``aten._fused_rms_norm`` (float32/float64, 1-D weight
  over the last dim), on devices where that op has a kernel (not the CPU: there it is
  CompositeImplicit and would trace straight back to the pattern). A traced pattern.
* ``rotary_fusion``: ``x * cos + rotate_half(x) * sin`` with
  ``rotate_half(x) = cat(-x[..., h:], x[..., :h])`` → ``graphgear::rotary_rotate_half``.
  A traced pattern.
* ``attention_fusion``: ``softmax(q @ k^T * scale [+ mask]) @ v`` (or ``/ inv_scale``),
  float mask added, softmax over the last dim → ``aten.scaled_dot_product_attention``,
  by the layout-agnostic matcher of :mod:`graphgear.passes.attention` (every graph kind,
  with or without Inductor's decompositions); on the CPU only under
  ``debug.run_eagerly``: where Inductor generates the code (max-autotune,
  reduce-overhead's CPU graph) its attention was measured faster than the CPU SDPA
  kernel on the decoder step.

Training graphs are fused before AOTAutograd differentiates them
(:func:`pre_grad_fusions`, static and symbolic sizes alike): the forward patterns are
rewritten to the fused ops, whose autograd formulas give the backward. Where that stage
cannot run (non-tensor, non-integer inputs, parameters held as graph attributes,
data-dependent input sizes, symbolic sizes in a graph that writes a buffer such as a
KV cache, a failed trace) the passes run on the joint forward+backward
graph instead: RMSNorm and rotary by their patterns traced forward and backward
together (which rarely appear whole: autograd interleaves other gradients, such as the
residual's, into them), attention only where it is not differentiated (see
:mod:`graphgear.passes.attention`). Every pass is a :class:`GraphPass`, run by a
:class:`PassManager` (timed, dumped, switchable).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from .._torch.fx import FakeTensor, FakeTensorMode, enable_python_dispatcher, fake_mode_of
from .._torch.inductor_passes import inductor_decomp_table, inductor_remove_noop_ops
from .._torch.ops import OpOverload, has_kernel_for_dispatch_key, op_schema
from ..config import mode_of
from ..stats import record_joint_passes
from . import ops
from .attention import fuse_attention
from .manager import GraphPass, PassManager, node_val, sort_and_clean
from .patterns import PatternSet, Replacement, decomp_kind

log = logging.getLogger(__name__)

aten = torch.ops.aten

__all__ = ["joint_graph_passes", "joint_pass_manager", "pre_grad_fusions"]



def _nodes(match: Any, *targets: Any) -> list[fx.Node]:
    return [n for n in match.nodes if n.op == "call_function" and n.target in targets]


def _is_last_dim(dims: Any, rank: int) -> bool:
    if isinstance(dims, int):
        dims = [dims]
    return list(dims) in ([-1], [rank - 1])


# ---------------------------------------------------------------- RMSNorm


def _rms_a(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rms_b(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * w


def _rms_replace(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return aten._fused_rms_norm.default(x, [x.shape[-1]], w, eps)[0]


_DISPATCH_KEY = {"cpu": "CPU", "cuda": "CUDA", "mps": "MPS", "xpu": "XPU", "npu": "PrivateUse1"}


def fused_rms_norm_kernel(device: torch.device) -> bool:
    """Whether ``aten._fused_rms_norm`` has a real kernel on ``device``. On the CPU (torch
    2.13) it has none: it is CompositeImplicit and traces back into the unfused ops, so
    the rewrite would buy nothing."""
    key = _DISPATCH_KEY.get(device.type)
    return key is not None and has_kernel_for_dispatch_key("aten::_fused_rms_norm", key)


def _rms_check(match: Any) -> bool:
    x, w = node_val(match.kwargs.get("x")), node_val(match.kwargs.get("w"))
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return False
    if not fused_rms_norm_kernel(x.device):
        return False
    # _fused_rms_norm computes in float32 for half inputs, the pattern in half: refuse
    if x.dtype not in (torch.float32, torch.float64) or w.dtype != x.dtype:
        return False
    if w.dim() != 1 or x.dim() < 1 or w.shape[0] != x.shape[-1]:
        return False
    for n in _nodes(match, aten.pow.Tensor_Scalar):
        if n.args[1] != 2:
            return False
    for n in _nodes(match, aten.mean.dim):
        if not _is_last_dim(n.args[1], x.dim()) or not (n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim")):
            return False
    out = node_val(match.output_nodes()[0]) if match.output_nodes() else None
    return not (isinstance(out, torch.Tensor) and out.shape != x.shape)


def _rms_inputs(training: bool) -> list[Any]:
    return [torch.randn(2, 3, 8, requires_grad=training), torch.randn(8, requires_grad=training), 1e-6]


# ---------------------------------------------------------------- rotary



def _rope_a(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + ops.rotate_half(x) * sin


def _rope_b(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return (x * cos) + (torch.cat((-x2, x1), dim=-1) * sin)


def _rope_replace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.ops.graphgear.rotary_rotate_half.default(x, cos, sin)


def _rope_check(match: Any) -> bool:
    x, cos, sin = (node_val(match.kwargs.get(k)) for k in ("x", "cos", "sin"))
    if not all(isinstance(t, torch.Tensor) for t in (x, cos, sin)):
        return False
    if not (x.dtype == cos.dtype == sin.dtype) or not x.dtype.is_floating_point:
        return False
    d = x.shape[-1]
    if not isinstance(d, int) or d % 2 or cos.shape[-1] != d or sin.shape[-1] != d:
        return False
    try:
        if torch.broadcast_shapes(x.shape, cos.shape, sin.shape) != x.shape:
            return False
    except RuntimeError:
        return False
    h = d // 2
    for n in _nodes(match, aten.slice.Tensor):
        dim = n.args[1] if len(n.args) > 1 else 0
        start = n.args[2] if len(n.args) > 2 else None
        end = n.args[3] if len(n.args) > 3 else None
        step = n.args[4] if len(n.args) > 4 else 1
        if dim not in (-1, x.dim() - 1) or step != 1:
            return False
        if (start in (0, None) and end == h) or (start == h and (end is None or end >= d)):
            continue
        return False
    for n in _nodes(match, aten.cat.default):
        dim = n.args[1] if len(n.args) > 1 else 0
        if dim not in (-1, x.dim() - 1):
            return False
        first = n.args[0][0]
        if not (isinstance(first, fx.Node) and first.target is aten.neg.default):
            return False
    return True


def _rope_inputs(training: bool) -> list[Any]:
    return [
        torch.randn(2, 4, 3, 8, requires_grad=training),
        torch.randn(1, 1, 3, 8),
        torch.randn(1, 1, 3, 8),
    ]


# ---------------------------------------------------------------- registry


@functools.cache
def builtin_patterns() -> PatternSet:
    """The built-in fusions, each traced for inference and for training graphs."""
    ps = PatternSet()
    for training in (False, True):
        sfx = "_training" if training else ""
        for fn in (_rms_a, _rms_b):
            ps.add(f"rms_norm{sfx}", Replacement(
                fn.__name__, fn, _rms_replace, functools.partial(_rms_inputs, training),
                extra_check=_rms_check, scalar_workaround={"eps": 1e-6}, training=training))
        for fn in (_rope_a, _rope_b):
            ps.add(f"rotary{sfx}", Replacement(
                fn.__name__, fn, _rope_replace, functools.partial(_rope_inputs, training),
                extra_check=_rope_check, training=training))
    return ps


def _kind_of(gm: fx.GraphModule, config: Any) -> str:
    """A pre-grad graph is traced without decompositions, whatever the mode."""
    return "aten" if gm.meta.get("graphgear_pre_grad") else decomp_kind(config)


def _is_joint(gm: fx.GraphModule) -> bool:
    return any(p.name.startswith("tangents") for p in gm.graph.find_nodes(op="placeholder"))


class _FusionPass(GraphPass):
    group = ""

    def enabled(self, config: Any) -> bool:
        return bool(config.experimental_config.fx_passes)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
        group = self.group + ("_training" if _is_joint(gm) else "")
        n = builtin_patterns().apply(gm, _kind_of(gm, config), [group])[group]
        if n:
            sort_and_clean(gm)
        return n


class RMSNormFusion(_FusionPass):
    name = "rms_norm_fusion"
    group = "rms_norm"


class RotaryFusion(_FusionPass):
    name = "rotary_fusion"
    group = "rotary"


def attention_skip_devices(config: Any) -> tuple[str, ...]:
    """Device types whose attention stays unfused. Where Inductor generates the code
    (max-autotune, and reduce-overhead's CPU graph), its attention beats the CPU SDPA
    kernel on the decoder step (benchmarks/bench_passes.py): on the CPU only
    run_eagerly gets SDPA."""
    return () if mode_of(config) == "eager" else ("cpu",)


class AttentionFusion(GraphPass):
    """The hand matcher of :mod:`graphgear.passes.attention`, on every graph the joint
    passes see (inference, pre-grad training, joint); a graph made with Inductor's
    decompositions gets the replacement traced with them."""

    name = "attention_fusion"

    def enabled(self, config: Any) -> bool:
        return bool(config.experimental_config.fx_passes)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
        table = inductor_decomp_table() if _kind_of(gm, config) == "inductor" else None
        return fuse_attention(gm, skip_devices=attention_skip_devices(config), decompositions=table)


class NormalizeNoops(GraphPass):
    """Drop the no-op views and expands the pattern graphs were traced without
    (Inductor's ``remove_noop_ops``), so the patterns can match."""

    name = "joint_remove_noops"

    def enabled(self, config: Any) -> bool:
        return bool(config.experimental_config.fx_passes)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
        before = len(gm.graph.nodes)
        inductor_remove_noop_ops(gm.graph)
        return before - len(gm.graph.nodes)


def joint_pass_manager() -> PassManager:
    return PassManager([NormalizeNoops(), RMSNormFusion(), RotaryFusion(), AttentionFusion()])


def joint_graph_passes(gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any,
                       training: bool | None = None) -> int:
    """Run the joint-graph fusion passes on ``gm`` in place; returns the number of rewrites.
    ``training``: a forward graph about to be differentiated (:func:`pre_grad_fusions`),
    searched with the forward patterns without decompositions (logged as training)."""
    if not config.experimental_config.fx_passes:
        return 0
    t0 = time.perf_counter()
    if training:
        gm.meta["graphgear_pre_grad"] = True
    before = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    counts: dict[str, int] = {}
    joint_pass_manager().run(gm, example_inputs, config, counts=counts, dump_name="joint")
    after = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    rewrites = sum(v for k, v in counts.items() if k != NormalizeNoops.name)
    entry = {"training": bool(training) or _is_joint(gm), "kind": _kind_of(gm, config),
             "pre_grad": bool(training), "matches": counts,
             "nodes_before": before, "nodes_after": after, "seconds": time.perf_counter() - t0}
    record_joint_passes(entry)
    log.info("graphgear joint passes (%s, %s): %s; %d -> %d ops in %.3fs",
             "training" if entry["training"] else "inference", entry["kind"], counts, before,
             after, entry["seconds"])
    return rewrites



# ---------------------------------------------------------------- training: before autograd


def _has_symbols(t: torch.Tensor) -> bool:
    return any(isinstance(s, torch.SymInt) for s in (*t.shape, *t.stride()))


def _needs_grad(example_inputs: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


def pre_grad_fusions(gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> fx.GraphModule | None:
    """Training graphs: the fusions on the forward graph, before AOTAutograd differentiates it.

    In a joint graph autograd interleaves other gradients (the residual's) into the
    pattern's backward, so traced forward+backward patterns rarely appear, and an
    attention's backward cannot be rewritten there at all. Here the dynamo graph is
    traced to a functional aten graph (no decompositions; symbolic sizes traced as
    AOTAutograd traces them, with the Python dispatcher on, and only where the graph
    writes nothing, as functionalization would specialise them), the forward patterns are
    rewritten to the fused ops (each has an autograd formula), and the result is what
    AOTAutograd traces: fused forward and backward. Returns the graph for AOTAutograd
    (the rewritten one, or ``gm`` itself where nothing matched), or None where the graph
    is not one this handles (inference, inputs other than tensors and integers,
    parameters held as attributes, data-dependent input sizes, symbolic sizes with an
    in-place write, a trace failure): the
    joint-graph passes then run on the joint graph.
    """
    if not config.experimental_config.fx_passes or not _needs_grad(example_inputs):
        return None
    if not all(isinstance(t, torch.Tensor | torch.SymInt | int) for t in example_inputs):
        return None
    if any(True for _ in gm.parameters()) or any(True for _ in gm.buffers()):
        return None  # make_fx would turn them into constants: no gradients, lost writes
    fake_mode = fake_mode_of(example_inputs)
    try:
        if fake_mode is None:
            fake_mode = FakeTensorMode()
        fakes = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)
                 else t for t in example_inputs]
        if any(isinstance(t, torch.Tensor) and free_unbacked_symbols(t) for t in fakes):
            return None  # data-dependent sizes: left to the joint passes
        symbolic = any(isinstance(t, torch.SymInt) or (isinstance(t, torch.Tensor) and _has_symbols(t))
                       for t in fakes)
        # symbolic sizes trace as AOTAutograd traces them: the Python dispatcher on, and
        # no torch.func.functionalize, whose wrappers read concrete sizes (a biased
        # linear on a 3-D input specialised the batch); a graph that writes is left to
        # the joint passes
        with fake_mode, enable_python_dispatcher(), torch.no_grad():
            traced = make_fx(gm if symbolic else torch.func.functionalize(gm, remove="mutations"),
                             tracing_mode="real")(*fakes)
        if symbolic and any(isinstance(n.target, OpOverload) and op_schema(n.target).is_mutable
                            for n in traced.graph.nodes):
            return None
    except Exception as e:  # noqa: BLE001 - any trace failure leaves the graph as it is
        log.debug("graphgear: pre-grad fusions skipped, trace failed: %s", e)
        return None
    old = list(gm.graph.find_nodes(op="placeholder"))
    new = list(traced.graph.find_nodes(op="placeholder"))
    if len(old) != len(new):
        return None
    for o, n in zip(old, new):  # dynamo's input metadata (static inputs, sources) for AOT
        val = n.meta.get("val")
        n.meta.update(o.meta)
        if val is not None:
            n.meta["val"] = val
    traced.meta.update(gm.meta)
    rewrites = joint_graph_passes(traced, fakes, config, training=True)
    if not rewrites:
        return gm
    for n in traced.graph.nodes:  # AOTAutograd joins the stack traces it finds
        if "stack_trace" in n.meta and not isinstance(n.meta["stack_trace"], str):
            del n.meta["stack_trace"]
    traced.graph.eliminate_dead_code()
    traced.recompile()
    return traced

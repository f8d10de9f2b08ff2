"""The fused ops the fusion passes rewrite to, and how to undo them for Inductor.

* RMSNorm → ``aten._fused_rms_norm`` (ATen has it in 2.13 with an autograd formula and
  a decomposition, and a real kernel on CUDA; on the CPU it is CompositeImplicit and
  traces straight back to aten ops, so the fusion skips the CPU); no graphgear op is
  needed.
* Rotate-half rotary embedding → ``graphgear::rotary_rotate_half(x, cos, sin)``
  (``x * cos + rotate_half(x) * sin``), defined here with a CPU/CUDA implementation,
  a fake implementation and an autograd formula.
* Attention → ``aten.scaled_dot_product_attention``.

Inductor gets a lowering for the graphgear op (built from its pointwise lowerings, so
it fuses into generated code wherever Inductor compiles: max-autotune and the CPU
graph). ``_fused_rms_norm`` has only an extern fallback in Inductor, so
:func:`inline_decompositions` rewrites it back into aten ops just before
``max-autotune`` hands a graph to Inductor.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from .._torch.fx import fake_mode_of, pytree
from .._torch.inductor import inductor_lowering
from .._torch.ops import decomp_fused_rms_norm, decomp_fused_rms_norm_backward

log = logging.getLogger(__name__)

aten = torch.ops.aten

__all__ = ["inline_decompositions", "inductor_fused_op_decompositions", "register_inductor_lowering",
           "rotary_rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The unfused formula, as models write it (the decomposition of the fused op)."""
    return x * cos + rotate_half(x) * sin


def _rotary_out_meta(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Size, torch.dtype]:
    """The output's shape and dtype: broadcast and promoted over the three inputs."""
    shape = torch.broadcast_shapes(x.shape, cos.shape, sin.shape)
    dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    return shape, dtype


@torch.library.custom_op("graphgear::rotary_rotate_half", mutates_args=())
def rotary_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in three kernels and no concatenation.

    The halves are written in place into the product ``x * cos``:
    ``out[:h] += (-x[h:]) * sin[:h]`` and ``out[h:] += x[:h] * sin[h:]``. Each element
    sees the same two roundings as the unfused formula (a product, then a sum).

    The output is always a new contiguous tensor, whatever the layout of ``x`` (models
    pass ``q.transpose(1, 2)``), exactly as the fake implementation says: graphs traced
    with the fake's strides view the output by them (``_unsafe_view`` after a matmul).
    """
    if x.shape[-1] % 2:
        raise ValueError(
            f"graphgear::rotary_rotate_half: the last dim of x must be even, got "
            f"shape {tuple(x.shape)}."
        )
    shape, dtype = _rotary_out_meta(x, cos, sin)
    out = torch.empty(shape, dtype=dtype, device=x.device)  # contiguous, as the fake
    if shape != x.shape or dtype != x.dtype:
        # cos or sin broadcasts to more dims than x, or promotes: the plain formula
        return out.copy_(_rotary_reference(x, cos, sin))
    torch.mul(x, cos, out=out)
    h = x.shape[-1] // 2
    sin_b = sin.expand(shape)
    out[..., :h].add_(x[..., h:] * sin_b[..., :h], alpha=-1)
    out[..., h:].add_(x[..., :h] * sin_b[..., h:])
    return out


@rotary_rotate_half.register_fake
def _rotary_fake(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    shape, dtype = _rotary_out_meta(x, cos, sin)
    return x.new_empty(shape, dtype=dtype)  # contiguous, as the real kernel


def _rotary_setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, cos, sin = inputs
    ctx.save_for_backward(x, cos, sin)


def _unbroadcast(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return g.sum_to_size(like.shape) if g.shape != like.shape else g


def _rotary_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, cos, sin = ctx.saved_tensors
    gx = gcos = gsin = None
    if ctx.needs_input_grad[0]:
        # d/dx of rotate_half(x) * sin is -rotate_half(grad * sin)
        gs = grad * sin
        gx = _unbroadcast(grad * cos - rotate_half(gs), x)
    if ctx.needs_input_grad[1]:
        gcos = _unbroadcast(grad * x, cos)
    if ctx.needs_input_grad[2]:
        gsin = _unbroadcast(grad * rotate_half(x), sin)
    return gx, gcos, gsin


rotary_rotate_half.register_autograd(_rotary_backward, setup_context=_rotary_setup_context)


def _fused_rms_norm_decomp(
    x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None, eps: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return decomp_fused_rms_norm(x, normalized_shape, weight, eps)


def inductor_fused_op_decompositions() -> dict[Any, Callable[..., Any]]:
    """The fused ops Inductor cannot fuse further, with the aten formula it can."""
    return {
        aten._fused_rms_norm.default: _fused_rms_norm_decomp,
        aten._fused_rms_norm_backward.default: decomp_fused_rms_norm_backward(),
    }


def _fake_mode_of(gm: fx.GraphModule) -> Any:
    vals = [n.meta.get("val") for n in gm.graph.nodes if "val" in n.meta]
    return fake_mode_of(vals)


def inline_decompositions(gm: fx.GraphModule, table: dict[Any, Callable[..., Any]],
                          select: Callable[[fx.Node], bool] | None = None,
                          decompositions: dict[Any, Any] | None = None) -> int:
    """Replace every call of an op in ``table`` (for which ``select`` holds, if given)
    by the traced aten ops of its decomposition, in place, traced with
    ``decompositions`` (the table the graph was made with: Inductor's takes graphs
    without the ops it decomposes). Returns the number of calls replaced."""
    targets = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in table
               and (select is None or select(n))]
    if not targets:
        return 0
    fake_mode = _fake_mode_of(gm)
    count = 0
    for node in targets:
        flat, spec = pytree.tree_flatten((node.args, node.kwargs))
        node_pos = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]
        if any("val" not in flat[i].meta for i in node_pos):
            log.debug("graphgear: %s has inputs without fake values; left fused", node.name)
            continue

        def fn(*tensors: Any, _flat: list[Any] = flat, _pos: list[int] = node_pos,
               _spec: Any = spec, _decomp: Callable[..., Any] = table[node.target]) -> Any:
            full = list(_flat)
            for i, t in zip(_pos, tensors):
                full[i] = t
            args, kwargs = pytree.tree_unflatten(full, _spec)
            return _decomp(*args, **kwargs)

        vals = [flat[i].meta["val"] for i in node_pos]
        ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
        with ctx:
            sub = make_fx(fn, decomposition_table=decompositions or {}, tracing_mode="real")(*vals)
        env: dict[fx.Node, Any] = {}
        placeholders = list(sub.graph.find_nodes(op="placeholder"))
        for ph, i in zip(placeholders, node_pos):
            env[ph] = flat[i]
        with gm.graph.inserting_before(node):
            out = gm.graph.graph_copy(sub.graph, env)
        _replace_outputs(gm.graph, node, out)
        count += 1
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return count


def _replace_outputs(graph: fx.Graph, node: fx.Node, out: Any) -> None:
    if isinstance(out, list | tuple):
        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(out[user.args[1]])
                graph.erase_node(user)
        if node.users:
            raise RuntimeError(
                f"graphgear: cannot inline {node.target}: its tuple result is used whole "
                f"by {list(node.users)}."
            )
    else:
        node.replace_all_uses_with(out)
    graph.erase_node(node)


def register_inductor_lowering() -> None:
    """Give Inductor a lowering for ``graphgear::rotary_rotate_half`` built from its own
    pointwise lowerings, so any Inductor compile (max-autotune, the CPU graph) fuses it
    into generated code instead of calling back into Python."""
    try:
        lowering = inductor_lowering()
        lowerings, register_lowering = lowering.lowerings, lowering.register_lowering
    except Exception as e:  # pragma: no cover - Inductor missing or changed
        log.debug("graphgear: no Inductor lowering for rotary_rotate_half: %s", e)
        return
    target = torch.ops.graphgear.rotary_rotate_half.default
    if target in lowerings:
        return

    @register_lowering(target, type_promotion_kind=None)
    def _lower_rotary(x: Any, cos: Any, sin: Any) -> Any:
        d = x.get_size()[-1]
        h = d // 2
        rank = len(x.get_size())
        x1 = lowerings[aten.slice.Tensor](x, rank - 1, 0, h)
        x2 = lowerings[aten.slice.Tensor](x, rank - 1, h, d)
        rot = lowerings[aten.cat.default]([lowerings[aten.neg.default](x2), x1], rank - 1)
        return lowerings[aten.add.Tensor](
            lowerings[aten.mul.Tensor](x, cos), lowerings[aten.mul.Tensor](rot, sin))



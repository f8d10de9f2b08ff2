"""Attention → ``scaled_dot_product_attention``, matched by hand: graphgear's one
attention fusion, for inference graphs and for training graphs.

Training graphs are fused before AOTAutograd differentiates them
(:func:`graphgear.passes.joint.pre_grad_fusions`), so the backward is SDPA's own. A
joint forward+backward graph reaches this matcher only where that stage could not run;
there an attention that is differentiated is never rewritten (its intermediates are
read by the backward, which the single-reader rule below refuses), and one that is
not differentiated is rewritten as in an inference graph.

``torch.matmul`` on 4-D tensors traces to ``expand`` + ``view`` + ``bmm`` when its
inputs are contiguous and to ``expand`` + ``clone`` + ``_unsafe_view`` + ``bmm`` when
they are not (a transposed ``q``, a ``repeat_kv`` key), so a traced pattern matches
only one layout. This matcher follows the data instead, from each softmax::

    scores = view(bmm(flat(q), flat(k^T)))          k^T = transpose(k, -2, -1)
    probs  = softmax(scores * scale [or / c] [+ mask], -1)
    out    = view(bmm(flat(probs), flat(v)))

where ``flat(x)`` is ``x`` through a no-op ``expand``, an optional contiguous
``clone`` and a ``view``/``_unsafe_view`` to 3-D, and ``softmax`` is ``aten._softmax``
or its decomposed form in graphs made with Inductor's decompositions (max-autotune)::

    e = exp(x - amax(x, [-1], keepdim=True));  probs = e / sum(e, [-1], keepdim=True)

(for half inputs with ``x`` cast to float32 first and ``probs`` cast back). Every
intermediate must have no reader outside the match. The mask must be a float tensor of
the scores' dtype that broadcasts to the scores (added, as SDPA adds it); boolean masks
are left alone.

The replacement is the composite ``aten.scaled_dot_product_attention`` op; in a graph
made with a decomposition table it is traced with that table first (on the CPU:
``_scaled_dot_product_flash_attention_for_cpu``, decomposed as Inductor decomposes
it), so the graph stays in the form its compiler expects.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from .._torch.fx import enable_python_dispatcher, fake_mode_of, node_erased
from ..shapes import known_equal
from .manager import node_val

aten = torch.ops.aten
prims = torch.ops.prims

__all__ = ["fuse_attention"]

_FLAT = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_HALF = (torch.float16, torch.bfloat16)


def _single(n: fx.Node) -> bool:
    return len(n.users) == 1


def _read_only_by(n: fx.Node, nodes: list[fx.Node]) -> bool:
    """Every reader of ``n`` is one of ``nodes`` (the match so far)."""
    return all(u in nodes for u in n.users)


def _last_dim(dims: object, rank: int = 4) -> bool:
    if isinstance(dims, int):
        dims = [dims]
    return isinstance(dims, list | tuple) and list(dims) in ([-1], [rank - 1])


def _keepdim(n: fx.Node) -> bool:
    return bool(n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False))


def _unflat(n: object) -> tuple[fx.Node, list[fx.Node]] | None:
    """``flat(x)`` → (x, nodes passed). ``x`` is 4-D, the expand a no-op."""
    if not isinstance(n, fx.Node) or n.target not in _FLAT:
        return None
    passed = [n]
    cur = n.args[0]
    if isinstance(cur, fx.Node) and cur.target is aten.clone.default:
        if not _single(cur):
            return None
        passed.append(cur)
        cur = cur.args[0]
    if not isinstance(cur, fx.Node) or cur.target is not aten.expand.default or not _single(cur):
        return None
    src = cur.args[0]
    vs, ve = node_val(src), node_val(cur)
    if not isinstance(src, fx.Node) or not isinstance(vs, torch.Tensor) \
            or not isinstance(ve, torch.Tensor) or vs.dim() != 4 or not known_equal(vs.shape, ve.shape):
        return None
    passed.append(cur)
    return src, passed


def _scalar(x: object) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def _softmax(n: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """``n`` an ``aten._softmax`` or the ``amax`` of a decomposed softmax over the last
    dim: (its input, its output, the nodes it is made of), else None."""
    if n.target is aten._softmax.default:
        if len(n.args) < 3 or n.args[2] or not _last_dim(n.args[1]) or not isinstance(n.args[0], fx.Node):
            return None  # args[2]: half_to_float, a float32 result for half inputs
        return n.args[0], n, [n]
    x = n.args[0]
    if not isinstance(x, fx.Node) or not _last_dim(n.args[1]) or not _keepdim(n) or not _single(n):
        return None
    sub = next(iter(n.users))
    if sub.target is not aten.sub.Tensor or sub.args[:2] != (x, n) or not _single(sub):
        return None
    exp = next(iter(sub.users))
    if exp.target is not aten.exp.default or len(exp.users) != 2:
        return None
    total = next((u for u in exp.users if u.target is aten.sum.dim_IntList), None)
    div = next((u for u in exp.users if u.target is aten.div.Tensor), None)
    if total is None or div is None or total.args[0] is not exp or not _last_dim(total.args[1]) \
            or not _keepdim(total) or div.args[:2] != (exp, total) or not _single(total):
        return None
    nodes = [n, sub, exp, total, div]
    if not _read_only_by(x, nodes):
        return None
    if x.target is not prims.convert_element_type.default:
        return x, div, nodes
    # half inputs: computed in float32, cast back
    src, vs = x.args[0], node_val(x.args[0])
    if x.args[1] != torch.float32 or not isinstance(src, fx.Node) or not isinstance(vs, torch.Tensor) \
            or vs.dtype not in _HALF or not _single(div):
        return None
    back = next(iter(div.users))
    if back.target is not prims.convert_element_type.default or back.args[1] != vs.dtype:
        return None
    return src, back, [*nodes, x, back]


def _match(start: fx.Node) -> tuple[dict[str, Any], list[fx.Node], fx.Node] | None:
    sm = _softmax(start)
    if sm is None:
        return None
    cur, probs, nodes = sm
    mask = None
    if cur.target is aten.add.Tensor and _read_only_by(cur, nodes):
        a, b = cur.args[0], cur.args[1]
        if not isinstance(b, fx.Node):
            return None
        nodes.append(cur)
        mask, cur = b, a
    if not isinstance(cur, fx.Node) or not _read_only_by(cur, nodes):
        return None
    if cur.target is aten.mul.Tensor and _scalar(cur.args[1]) is not None:
        scale = _scalar(cur.args[1])
    elif cur.target is aten.div.Tensor and _scalar(cur.args[1]):
        scale = 1.0 / _scalar(cur.args[1])  # type: ignore[operator]
    else:
        return None
    nodes.append(cur)
    scores = cur.args[0]
    if not isinstance(scores, fx.Node) or scores.target not in _FLAT or not _single(scores):
        return None
    bmm = scores.args[0]
    if not isinstance(bmm, fx.Node) or bmm.target is not aten.bmm.default or not _single(bmm):
        return None
    nodes += [scores, bmm]
    q_m, kt_m = _unflat(bmm.args[0]), _unflat(bmm.args[1])
    if q_m is None or kt_m is None:
        return None
    q, passed_q = q_m
    kt, passed_k = kt_m
    if not all(_single(n) for n in passed_q + passed_k):
        return None
    if kt.target is aten.transpose.int:
        if sorted(d % 4 for d in kt.args[1:3]) != [2, 3]:
            return None
    elif kt.target is aten.permute.default:
        if list(kt.args[1]) != [0, 1, 3, 2]:
            return None
    else:
        return None
    if not _single(kt):
        return None
    k = kt.args[0]
    nodes += passed_q + passed_k + [kt]
    # probs @ v
    if not _single(probs):
        return None
    fwd = next(iter(probs.users))
    while fwd.target in (aten.expand.default, aten.clone.default) and _single(fwd):
        fwd = next(iter(fwd.users))
    pv = _unflat(fwd)
    if pv is None or pv[0] is not probs:
        return None
    _, passed_p = pv
    flat_p = passed_p[0]
    if not all(_single(n) for n in passed_p):
        return None
    bmm2 = next(iter(flat_p.users))
    if bmm2.target is not aten.bmm.default or bmm2.args[0] is not flat_p or not _single(bmm2):
        return None
    v_m = _unflat(bmm2.args[1])
    if v_m is None or not all(_single(n) for n in v_m[1]):
        return None
    v, passed_v = v_m
    out = next(iter(bmm2.users))
    if out.target not in _FLAT:
        return None
    nodes += passed_p + [bmm2] + passed_v + [out]
    vq, vk, vv, vo = node_val(q), node_val(k), node_val(v), node_val(out)
    if not all(isinstance(t, torch.Tensor) for t in (vq, vk, vv, vo)):
        return None
    if vk.dim() != 4 or vv.dim() != 4 or vo.dim() != 4:  # type: ignore[union-attr]
        return None
    if not (vq.dtype == vk.dtype == vv.dtype) or vq.dtype not in _FLOATS:  # type: ignore[union-attr]
        return None
    # sizes compared without adding guards (symbolic sizes stay symbolic)
    if not known_equal(vq.shape[:2], vk.shape[:2]) or not known_equal(vk.shape[:2], vv.shape[:2]) \
            or not known_equal(vq.shape[-1], vk.shape[-1]) \
            or not known_equal(vk.shape[-2], vv.shape[-2]):  # type: ignore[union-attr,index]
        return None
    if not known_equal(tuple(vo.shape), (*vq.shape[:-1], vv.shape[-1])):  # type: ignore[union-attr,index]
        return None
    if mask is not None:
        vm = node_val(mask)
        scores_shape = (*vq.shape[:-1], vk.shape[-2])  # type: ignore[union-attr,index]
        if not isinstance(vm, torch.Tensor) or vm.dtype != vq.dtype:  # type: ignore[union-attr]
            return None  # bool masks select with -inf / finfo.min: other semantics
        # broadcasts to the scores: each of its dims (from the end) is 1 or the scores'
        if vm.dim() > 4 or not all(known_equal(m, 1) or known_equal(m, d)
                                   for m, d in zip(reversed(vm.shape), reversed(scores_shape))):
            return None
    return {"q": q, "k": k, "v": v, "mask": mask, "scale": scale}, nodes, out


def _traced_sdpa(graph: fx.Graph, args: dict[str, Any], decompositions: Mapping[Any, Any]) -> fx.Node:
    """SDPA traced with ``decompositions`` over the match's fake values, copied into
    ``graph`` at its insertion point; returns the node of its result."""
    names = ["q", "k", "v"] + (["mask"] if args["mask"] is not None else [])
    vals = [node_val(args[n]) for n in names]
    scale = args["scale"]

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor) -> torch.Tensor:
        return aten.scaled_dot_product_attention.default(
            q, k, v, attn_mask=mask[0] if mask else None, scale=scale)

    fake_mode = fake_mode_of(vals)
    with fake_mode if fake_mode is not None else contextlib.nullcontext(), enable_python_dispatcher(), \
            torch.no_grad():
        traced = make_fx(sdpa, decomposition_table=dict(decompositions), tracing_mode="real")(*vals)
    placeholders = list(traced.graph.find_nodes(op="placeholder"))
    result = graph.graph_copy(traced.graph, {p: args[n] for p, n in zip(placeholders, names)})
    if not isinstance(result, fx.Node):
        raise RuntimeError(f"graphgear: traced SDPA returned {result!r}, expected one tensor")
    return result


def fuse_attention(gm: fx.GraphModule, skip_devices: tuple[str, ...] = (),
                   decompositions: Mapping[Any, Any] | None = None) -> int:
    """Rewrite every matched attention in ``gm``; returns the count. Attention on a
    device type in ``skip_devices`` is left alone. ``decompositions``: the table ``gm``
    was made with, if any (the replacement is traced with it)."""
    graph = gm.graph
    count = 0
    starts = [*graph.find_nodes(op="call_function", target=aten._softmax.default),
              *graph.find_nodes(op="call_function", target=aten.amax.default)]
    for start in starts:
        if node_erased(start):
            continue
        m = _match(start)
        if m is None:
            continue
        args, nodes, out = m
        vq = node_val(args["q"])
        if isinstance(vq, torch.Tensor) and vq.device.type in skip_devices:
            continue
        with graph.inserting_before(out):
            if decompositions:
                new = _traced_sdpa(graph, args, decompositions)
            else:
                kwargs: dict[str, Any] = {"scale": args["scale"]}
                if args["mask"] is not None:
                    kwargs["attn_mask"] = args["mask"]
                new = graph.call_function(aten.scaled_dot_product_attention.default,
                                          (args["q"], args["k"], args["v"]), kwargs)
                vo = node_val(out)
                fake = getattr(vo, "fake_mode", None)
                if fake is not None:
                    with fake:
                        vk, vv = node_val(args["k"]), node_val(args["v"])
                        vm = node_val(args["mask"]) if args["mask"] is not None else None
                        new.meta["val"] = aten.scaled_dot_product_attention.default(
                            vq, vk, vv, attn_mask=vm, scale=args["scale"])
                else:
                    new.meta["val"] = vo
        new.meta.setdefault("stack_trace", out.meta.get("stack_trace"))
        out.replace_all_uses_with(new)
        dead = set(nodes)
        for n in reversed([n for n in graph.nodes if n in dead]):
            if not n.users:
                graph.erase_node(n)
        count += 1
    return count

"""Attention → ``scaled_dot_product_attention`` on inference graphs, matched by hand.

``torch.matmul`` on 4-D tensors traces to ``expand`` + ``view`` + ``bmm`` when its
inputs are contiguous and to ``expand`` + ``clone`` + ``_unsafe_view`` + ``bmm`` when
they are not (a transposed ``q``, a ``repeat_kv`` key), so a traced pattern matches
only one layout. This matcher follows the data instead, from each softmax::

    scores = view(bmm(flat(q), flat(k^T)))          k^T = transpose(k, -2, -1)
    probs  = _softmax(scores * scale [or / c] [+ mask], -1)
    out    = view(bmm(flat(probs), flat(v)))

where ``flat(x)`` is ``x`` through a no-op ``expand``, an optional contiguous
``clone`` and a ``view``/``_unsafe_view`` to 3-D. Every intermediate must have no
other reader. The mask must be a float tensor of the scores' dtype that broadcasts to
the scores (added, as SDPA adds it); boolean masks are left alone.
"""

from __future__ import annotations

import torch
from torch import fx

from .._torch import node_erased
from .manager import node_val

aten = torch.ops.aten

__all__ = ["fuse_attention"]

_FLAT = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)



def _single(n: fx.Node) -> bool:
    return len(n.users) == 1


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
            or not isinstance(ve, torch.Tensor) or vs.dim() != 4 or vs.shape != ve.shape:
        return None
    passed.append(cur)
    return src, passed


def _scalar(x: object) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def _match(softmax: fx.Node) -> tuple[dict[str, object], list[fx.Node], fx.Node] | None:
    if len(softmax.args) < 3 or softmax.args[2] or softmax.args[1] not in (-1, 3):
        return None
    nodes: list[fx.Node] = [softmax]
    cur = softmax.args[0]
    mask = None
    if isinstance(cur, fx.Node) and cur.target is aten.add.Tensor and _single(cur):
        a, b = cur.args[0], cur.args[1]
        if not isinstance(b, fx.Node):
            return None
        nodes.append(cur)
        mask, cur = b, a
    if not isinstance(cur, fx.Node) or not _single(cur):
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
    if not _single(softmax):
        return None
    fwd = next(iter(softmax.users))
    while fwd.target in (aten.expand.default, aten.clone.default) and _single(fwd):
        fwd = next(iter(fwd.users))
    pv = _unflat(fwd)
    if pv is None or pv[0] is not softmax:
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
    if not (vq.dtype == vk.dtype == vv.dtype) or not vq.dtype.is_floating_point:  # type: ignore[union-attr]
        return None
    if vq.shape[:2] != vk.shape[:2] or vk.shape[:2] != vv.shape[:2] \
            or vq.shape[-1] != vk.shape[-1] or vk.shape[-2] != vv.shape[-2]:  # type: ignore[union-attr,index]
        return None
    if tuple(vo.shape) != (*vq.shape[:-1], vv.shape[-1]):  # type: ignore[union-attr,index]
        return None
    if mask is not None:
        vm = node_val(mask)
        scores_shape = torch.Size((*vq.shape[:-1], vk.shape[-2]))  # type: ignore[union-attr,index]
        if not isinstance(vm, torch.Tensor) or vm.dtype != vq.dtype:  # type: ignore[union-attr]
            return None
        try:
            if torch.broadcast_shapes(vm.shape, scores_shape) != scores_shape:
                return None
        except RuntimeError:
            return None
    return {"q": q, "k": k, "v": v, "mask": mask, "scale": scale}, nodes, out


def fuse_attention(gm: fx.GraphModule, skip_devices: tuple[str, ...] = ()) -> int:
    """Rewrite every matched attention in ``gm`` (inference graphs); returns the count.
    Attention on a device type in ``skip_devices`` is left alone."""
    graph = gm.graph
    count = 0
    for softmax in list(graph.find_nodes(op="call_function", target=aten._softmax.default)):
        if node_erased(softmax):
            continue
        m = _match(softmax)
        if m is None:
            continue
        args, nodes, out = m
        vq0 = node_val(args["q"])
        if isinstance(vq0, torch.Tensor) and vq0.device.type in skip_devices:
            continue
        kwargs = {"scale": args["scale"]}
        if args["mask"] is not None:
            kwargs["attn_mask"] = args["mask"]
        with graph.inserting_before(out):
            new = graph.call_function(aten.scaled_dot_product_attention.default,
                                      (args["q"], args["k"], args["v"]), kwargs)
        vo = node_val(out)
        vq, vk, vv = node_val(args["q"]), node_val(args["k"]), node_val(args["v"])
        fake = getattr(vo, "fake_mode", None)
        if fake is not None:
            with fake:
                new.meta["val"] = torch.ops.aten.scaled_dot_product_attention.default(
                    vq, vk, vv, attn_mask=node_val(args["mask"]) if args["mask"] is not None else None,
                    scale=args["scale"])
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

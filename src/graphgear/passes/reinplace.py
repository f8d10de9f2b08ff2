"""In-place recovery: a functional op whose result is copied back into a graph input
becomes the op's in-place variant on that input.

AOTAutograd functionalizes ``cache[:b].index_copy_(2, pos, k)`` into::

    s = slice(cache, 0, 0, b); y = index_copy(s, 2, pos, k)
    new = slice_scatter(cache, y, 0, 0, b); ...; copy_(cache, new)

which computes a whole new cache and copies it back. This pass turns it into
``index_copy_(slice(cache, 0, 0, b), 2, pos, k)`` and drops ``slice_scatter`` and
``copy_``, so a captured graph writes the KV cache directly. It only rewrites when no
node reads the input's old value after the functional op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from .._torch.ops import OpOverload, op_overload_name, op_schema
from .manager import GraphPass

aten = torch.ops.aten

__all__ = ["ReinplaceInputs", "inplace_variant"]


def inplace_variant(target: Any) -> Any:
    """``aten.index_copy.default`` -> ``aten.index_copy_.default`` (None when none exists)."""
    if not isinstance(target, OpOverload):
        return None
    packet = target.overloadpacket
    ns = getattr(torch.ops, target.namespace)
    inplace_packet = getattr(ns, packet.__name__ + "_", None)
    if inplace_packet is None:
        return None
    op = getattr(inplace_packet, op_overload_name(target), None)
    if op is None:
        return None
    args = op_schema(op).arguments
    if not args or args[0].alias_info is None or not args[0].alias_info.is_write:
        return None
    return op


_VIEW_OPS = {aten.slice.Tensor, aten.select.int, aten.view.default, aten.permute.default,
             aten.transpose.int, aten.expand.default, aten.unsqueeze.default,
             aten.squeeze.dim, aten.alias.default, aten.t.default, aten.as_strided.default,
             aten._unsafe_view.default}


def _old_value_readers(root: fx.Node, skip: set[fx.Node]) -> list[fx.Node]:
    """Nodes that read ``root``'s value, directly or through views (not through ``skip``)."""
    out: list[fx.Node] = []
    stack = [root]
    seen: set[fx.Node] = set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in skip or u in seen:
                continue
            seen.add(u)
            if u.op == "call_function" and u.target in _VIEW_OPS and u.args and u.args[0] is n:
                stack.append(u)
            else:
                out.append(u)
    return out


def _same(a: Any, b: Any) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and va.dtype == vb.dtype and va.shape == vb.shape)


class ReinplaceInputs(GraphPass):
    name = "reinplace_inputs"

    def enabled(self, config: Any) -> bool:
        return bool(config.experimental_config.input_inplace_pass)  # TorchAir's name for it

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
        graph = gm.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        output = next(iter(graph.find_nodes(op="output")))
        outputs = set(output.all_input_nodes)
        changed = 0
        for copy in list(graph.find_nodes(op="call_function", target=aten.copy_.default)):
            dst, src = copy.args[0], copy.args[1]
            if not isinstance(dst, fx.Node) or dst.op != "placeholder" or not isinstance(src, fx.Node):
                continue
            scatter = None
            if src.target is aten.slice_scatter.default and src.args[0] is dst:
                scatter = src
                y = src.args[1]
            else:
                y = src
            if not isinstance(y, fx.Node) or y.op != "call_function" or not y.args:
                continue
            op = inplace_variant(y.target)
            base = y.args[0]
            if op is None or not isinstance(base, fx.Node) or not _same(y, base):
                continue
            if scatter is not None:
                # base must be exactly the slice the scatter writes back
                sargs = list(scatter.args[2:]) + [None] * (4 - len(scatter.args[2:]))
                if base.target is not aten.slice.Tensor or base.args[0] is not dst:
                    continue
                bargs = list(base.args[1:]) + [None] * (4 - len(base.args[1:]))
                norm = [0, None, None, 1]
                if [a if a is not None else d for a, d in zip(bargs, norm)] != \
                        [a if a is not None else d for a, d in zip(sargs, norm)]:
                    continue
                if any(u is not y and order[u] > order[y] for u in base.users):
                    continue
            elif base is not dst:
                continue
            if y in outputs or src in outputs:
                continue
            skip = {copy, src, y} | ({base} if scatter is not None else set())
            if any(order[r] > order[y] for r in _old_value_readers(dst, skip)):
                continue
            # rewrite: y writes into the input; every reader of the new value reads the input
            y.target = op
            for u in list(src.users):
                if u is not copy:
                    u.replace_input_with(src, dst)
            if scatter is not None:
                for u in list(y.users):
                    if u is not scatter:
                        u.replace_input_with(y, base)
            copy.replace_all_uses_with(dst)
            graph.erase_node(copy)
            if scatter is not None:
                graph.erase_node(scatter)
            changed += 1
        return changed

"""Remove ops that do nothing: identity views/reshapes, ``x + 0``, ``x * 1``, clones
whose result is only read, and type conversions to the dtype a tensor already has."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from ..shapes import known_equal
from .manager import GraphPass

aten = torch.ops.aten


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _same_meta(a: Any, b: Any) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.dtype == b.dtype
        and a.device == b.device
        and known_equal(a.shape, b.shape)
        and known_equal(a.stride(), b.stride())
    )


_COPIES = (aten.clone.default, aten._to_copy.default)


def _written(node: fx.Node) -> bool:
    for user in node.users:
        if isinstance(user.target, torch._ops.OpOverload) and any(
            a.alias_info is not None and a.alias_info.is_write
            for a in user.target._schema.arguments
        ):
            return True
    return False


class RemoveNoopOps(GraphPass):
    name = "remove_noop_ops"

    def enabled(self, config: Any) -> bool:
        return bool(config.experimental_config.remove_noop_ops)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
        changed = 0
        out_node = next(iter(gm.graph.find_nodes(op="output")))
        outputs = set(out_node.all_input_nodes)
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or not node.args:
                continue
            src = node.args[0]
            if not isinstance(src, fx.Node):
                continue
            if self._is_noop(node, src):
                # an output must stay a distinct tensor only when it is a fresh copy;
                # views and reshapes that change nothing can always be dropped.
                if node.target in _COPIES and (
                    node in outputs or src.op == "placeholder" or _written(node)
                ):
                    continue
                node.replace_all_uses_with(src)
                gm.graph.erase_node(node)
                changed += 1
        return changed

    @staticmethod
    def _is_noop(node: fx.Node, src: fx.Node) -> bool:
        t = node.target
        out, inp = _val(node), _val(src)
        if not _same_meta(out, inp):
            return False
        if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                 aten.expand.default, aten.slice.Tensor, aten.alias.default,
                 aten._to_copy.default, aten.clone.default):
            if t is aten.slice.Tensor:
                return True
            if t is aten._to_copy.default and set(node.kwargs) - {"dtype", "layout", "device"}:
                return False
            return True
        scalar = node.args[1] if len(node.args) == 2 else None
        if type(scalar) in (int, float) and not node.kwargs:
            if t in (aten.add.Tensor, aten.sub.Tensor) and scalar == 0:
                return True
            if t in (aten.mul.Tensor, aten.div.Tensor) and scalar == 1:
                return True
        return False

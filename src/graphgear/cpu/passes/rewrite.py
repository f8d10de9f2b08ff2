"""What the CPU passes share: matching ``W.T`` and replacing a product by a call."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

__all__ = ["replace_node", "transposed"]

aten = torch.ops.aten


def transposed(node: object) -> object:
    """What ``node`` transposes when it is ``W.T`` (``t`` or ``permute(1, 0)``), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.t.default or (node.target is aten.permute.default and list(node.args[1]) == [1, 0]):
        return node.args[0]
    return None


def replace_node(g: fx.Graph, node: fx.Node, build: Callable[[], fx.Node]) -> fx.Node:
    """Replace ``node`` by what ``build()`` adds to ``g`` just before it (with
    ``node``'s metadata); returns the new node."""
    with g.inserting_before(node):
        new = build()
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    g.erase_node(node)
    return new

"""Remove ops that do nothing: identity views/reshapes, ``x + 0``, ``x * 1``, clones
whose result is only read, and type conversions to the dtype a tensor already has.

As Inductor's ``remove_noop_ops``, a removal must never create aliasing the eager
program does not have: a graph output that is a fresh tensor (``x + 0``, ``w * 1``, a
clone, or a view of one of those) must not become an input, a parameter, a view of
one, or another output; and an output that is a view must not become the very tensor
it viewed. Otherwise ``out.mul_(0)`` by the caller would write into the model's weight.
A fresh tensor that is written in place, or whose source is written in place anywhere
in the graph, is kept as well (the write would reach the other tensor).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from .._torch.storage import has_storage, storage_id
from ..inputs import written_arguments
from ..shapes import known_equal
from .manager import GraphPass, node_val

aten = torch.ops.aten



def _same_meta(a: Any, b: Any) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.dtype == b.dtype
        and a.device == b.device
        and known_equal(a.shape, b.shape)
        and known_equal(a.stride(), b.stride())
    )


def _storage(n: Any) -> int | None:
    """An id of the memory a node's value lives in (its fake tensor's storage, shared by
    every view of it); None when the node has no tensor value."""
    v = node_val(n)
    if not isinstance(v, torch.Tensor) or not has_storage(v):
        return None
    return storage_id(v.untyped_storage())


def _written_storages(graph: fx.Graph) -> set[int]:
    """Storages some op of the graph writes in place (a mutable schema argument,
    positional or keyword)."""
    out: set[int] = set()
    for node in graph.nodes:
        for arg in written_arguments(node):
            s = _storage(arg)
            if s is not None:
                out.add(s)
    return out


class RemoveNoopOps(GraphPass):
    name = "remove_noop_ops"

    def enabled(self, config: Any) -> bool:
        return bool(config.experimental_config.remove_noop_ops)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
        changed = 0
        graph = gm.graph
        out_node = next(iter(graph.find_nodes(op="output")))
        placeholders = set(graph.find_nodes(op="placeholder"))
        input_storages = {s for p in placeholders if (s := _storage(p)) is not None}
        output_storages = {s for o in out_node.all_input_nodes if (s := _storage(o)) is not None}
        written = _written_storages(graph)
        for node in list(graph.nodes):
            if node.op != "call_function" or not node.args:
                continue
            src = node.args[0]
            if not isinstance(src, fx.Node) or not self._is_noop(node, src):
                continue
            if self._would_alias(node, src, out_node, placeholders, input_storages,
                                 output_storages, written):
                continue
            node_storage, src_storage = _storage(node), _storage(src)
            node.replace_all_uses_with(src)
            graph.erase_node(node)
            if node_storage in output_storages and src_storage is not None:
                output_storages.add(src_storage)  # src (or a view of it) is returned now
            changed += 1
        return changed

    @staticmethod
    def _would_alias(
        node: fx.Node,
        src: fx.Node,
        out_node: fx.Node,
        placeholders: set[fx.Node],
        input_storages: set[int],
        output_storages: set[int],
        written: set[int],
    ) -> bool:
        """True when replacing ``node`` by ``src`` would make an output alias an input or
        another output, or let an in-place write reach a tensor it did not reach before."""
        node_storage, src_storage = _storage(node), _storage(src)
        outputs = set(out_node.all_input_nodes)
        is_view = node_storage is not None and node_storage == src_storage
        if not is_view:
            # node is a fresh tensor: dropping it shares its memory with src
            if node_storage in output_storages and (
                src_storage in input_storages or src_storage in output_storages
                or src in placeholders
            ):
                return True
            if node_storage in written or src_storage in written:
                return True
            return False
        # a view returned as an output may alias its base, but must not become it
        return node in outputs and (src in placeholders or src in outputs)

    @staticmethod
    def _is_noop(node: fx.Node, src: fx.Node) -> bool:
        t = node.target
        out, inp = node_val(node), node_val(src)
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

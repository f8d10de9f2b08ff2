"""``inplace_pass``: a functional op whose first argument is a tensor the graph made and
never reads again becomes the op's in-place variant on it (``y = add(x, 1)`` with ``x``
dead afterwards: ``add_(x, 1)``), saving an allocation and a write per op.

It runs only where the graph runs as it is (``passes.remove_cat.runs_as_is``): Inductor
re-inplaces the graphs it compiles itself (its ``reinplace_inplaceable_ops``), and
graphgear leaves that on whatever ``inplace_pass`` says (torch's switch for it is Inductor's
``disabled_passes="REINPLACE_INPLACEABLE_OPS"``; ``option_checks`` warns that the option
has no effect there). TorchAir's ``inplace_pass`` switches the same kind of pass on its NPU
graphs.

Only a tensor that owns its memory is written: one no other node's value shares (not a
view, not viewed, not a graph input or output), whose value and the op's result agree in
size, strides, dtype and device, and whose other readers all run before the op. That a
tensor is no view is read off the ops' schemas, not only off the nodes' fake values: an
earlier pass (``reinplace_inputs``) rewires a view onto a graph input and leaves its fake
value on a storage of its own (a ``slice`` of the cache then looked like a fresh tensor,
and writing it in place wrote the KV cache a second time).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import fx

from .._torch.ops import OpOverload, op_schema
from .manager import GraphPass, node_val
from .noop import _storage
from .reinplace import inplace_variant
from .remove_cat import runs_as_is

__all__ = ["ReinplaceIntermediates"]


def _same_layout(a: Any, b: Any) -> bool:
    return (a.dtype == b.dtype and a.device == b.device and tuple(a.shape) == tuple(b.shape)
            and tuple(a.stride()) == tuple(b.stride()))


def _aliases(node: fx.Node, arg: fx.Node) -> bool:
    """Whether ``node``'s op returns (a view of) or writes argument ``arg``: an alias
    annotation on an argument ``arg`` is passed as."""
    if not isinstance(node.target, OpOverload):
        return node.op == "call_function"  # getitem, operator.*: take it as an alias
    schema = op_schema(node.target)
    for i, a in enumerate(schema.arguments):
        v = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
        if (v is arg or (isinstance(v, list | tuple) and arg in v)) and a.alias_info is not None:
            return True
    return False


def _fresh(src: fx.Node, node: fx.Node) -> bool:
    """Whether ``src`` is a new tensor by its op's schema (no return aliases an input) and
    no node but ``node`` takes it as an alias."""
    if not isinstance(src.target, OpOverload):
        return False
    if any(r.alias_info is not None for r in op_schema(src.target).returns):
        return False
    return not any(u is not node and _aliases(u, src) for u in src.users)


class ReinplaceIntermediates(GraphPass):
    name = "reinplace_intermediates"

    def enabled(self, config: Any) -> bool:
        return bool(config.experimental_config.inplace_pass)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
        if not runs_as_is(config, example_inputs):
            return 0
        graph = gm.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        owners: dict[int, int] = {}
        for n in graph.nodes:
            s = _storage(n)
            if s is not None:
                owners[s] = owners.get(s, 0) + 1
        out_node = next(iter(graph.find_nodes(op="output")))
        outputs = set(out_node.all_input_nodes)
        changed = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or not isinstance(node.target, OpOverload) or not node.args:
                continue
            src = node.args[0]
            op = inplace_variant(node.target)
            if op is None or not isinstance(src, fx.Node) or src.op != "call_function" or src in outputs:
                continue
            sv, nv = node_val(src), node_val(node)
            s = _storage(src)
            if s is None or owners.get(s) != 1 or nv is None or not hasattr(nv, "stride") \
                    or not _same_layout(sv, nv):
                continue
            if any(u is not node and order[u] > order[node] for u in src.users) \
                    or node.args.count(src) > 1 or src in node.kwargs.values() or not _fresh(src, node):
                continue
            node.target = op  # in place: the node keeps its name (data dumps match by name)
            changed += 1
        return changed

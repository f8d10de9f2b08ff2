"""Per-input attributes of a graph: names, gears, static and mutated inputs.

The backend records them for the graph dynamo hands over (step 1 of the pipeline); the
mode compilers read them for the AOT graphs they receive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch import fx

from ._torch import OpOverload, TracingContext, dynamo_graph_arg
from .gears import get_dim_gears

__all__ = [
    "GraphInputs",
    "dynamo_input_names",
    "mutated_placeholders",
    "static_input_indices",
    "written_arguments",
]


@dataclasses.dataclass
class GraphInputs:
    """What the backend learnt about the inputs of one dynamo graph: the user's names
    and the gears recorded on them. (Static inputs are AOTAutograd's to say: see
    :func:`static_input_indices`.)"""

    names: list[str]
    dim_gears: dict[int, dict[int, list[int]]]  # input index -> {dim: gears}

    @classmethod
    def from_dynamo(cls, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> GraphInputs:
        gears = {i: g for i, x in enumerate(example_inputs) if (g := get_dim_gears(x))}
        return cls(names=dynamo_input_names(gm, len(example_inputs)), dim_gears=gears)


def dynamo_input_names(gm: fx.GraphModule, n: int) -> list[str]:
    """The user's names of the graph inputs (``x``, ``self.k_cache``), else positions."""
    names: list[str] = []
    for node in gm.graph.find_nodes(op="placeholder"):
        arg = dynamo_graph_arg(node)
        src = getattr(arg, "source", None)
        name = src.name if src is not None and hasattr(src, "name") else None
        if callable(name):
            name = name()
        names.append(_pretty_source(name) if name else node.name)
    names += [f"input {i}" for i in range(len(names), n)]
    return names[:n]


def _pretty_source(name: str) -> str:
    # L['x'] -> x ; L['self']._modules['a'].k_cache -> self.a.k_cache
    import re

    name = re.sub(r"\._(?:modules|parameters|buffers)\['([^']+)'\]", r".\1", name)
    name = re.sub(r"^[LG]\['([^']+)'\]", r"\1", name)
    return name


def static_input_indices(num_inputs: int) -> list[int]:
    """Indices AOTAutograd marked static (parameters, buffers, ``mark_static_address``)."""
    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    idx = getattr(meta, "static_input_indices", None)
    if idx is None:
        return []
    return [i for i in idx if i < num_inputs]


def mutated_placeholders(gm: fx.GraphModule) -> list[int]:
    """Indices of placeholders written in place by the graph (KV caches)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    index = {p: i for i, p in enumerate(placeholders)}
    out: set[int] = set()
    for node in gm.graph.nodes:
        for arg in written_arguments(node):
            base = _view_base(arg)
            if base in index:
                out.add(index[base])
    return sorted(out)


def written_arguments(node: fx.Node) -> list[fx.Node]:
    """The nodes an op call writes in place: every argument its schema marks mutable
    (``Tensor(a!)``, also inside lists), whether passed positionally or as a keyword
    (``copy_(self=dst, src=x)``, a keyword-only ``out=``)."""
    if node.op != "call_function" or not isinstance(node.target, OpOverload):
        return []
    out: list[fx.Node] = []
    for i, a in enumerate(node.target._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        if i < len(node.args) and not a.kwarg_only:
            value = node.args[i]
        elif a.name in node.kwargs:
            value = node.kwargs[a.name]
        else:
            continue
        values = value if isinstance(value, list | tuple) else [value]
        out.extend(v for v in values if isinstance(v, fx.Node))
    return out


def _view_base(node: fx.Node) -> fx.Node:
    while (
        node.op == "call_function"
        and isinstance(node.target, OpOverload)
        and node.target.is_view
        and node.args
        and isinstance(node.args[0], fx.Node)
    ):
        node = node.args[0]
    return node

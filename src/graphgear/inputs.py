"""Per-input attributes of a graph: names, gears, static and mutated inputs.

The backend records them for the graph dynamo hands over (step 1 of the pipeline); the
mode compilers read them for the AOT graphs they receive.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from ._torch.aot import aot_input_source
from ._torch.dynamo import dynamo_graph_arg
from ._torch.fx import TracingContext
from ._torch.ops import OpOverload, op_schema
from .errors import GearError
from .gears import get_dim_gears

__all__ = [
    "GraphInputs",
    "aot_input_names",
    "aot_input_positions",
    "dynamo_input_names",
    "input_name_matches",
    "mutated_placeholders",
    "named_input_gears",
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
    def from_dynamo(
        cls,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        input_gears: Mapping[str, Mapping[int, list[int]]] | None = None,
    ) -> GraphInputs:
        """Names and gears of dynamo's inputs: gears recorded on the tensors
        (``set_dim_gears``), then those ``input_gears`` names (config option
        ``inference_config.input_gears``) for dims the tensors have no gears for."""
        names = dynamo_input_names(gm, len(example_inputs))
        gears = {i: g for i, x in enumerate(example_inputs) if (g := get_dim_gears(x))}
        for i, dims in named_input_gears(names, example_inputs, input_gears or {}).items():
            mine = gears.setdefault(i, {})
            for dim, sizes in dims.items():
                mine.setdefault(dim, sizes)
        return cls(names=names, dim_gears=gears)


def input_name_matches(pattern: str, name: str) -> bool:
    """Whether an ``input_gears`` key names the input ``name``: the full name
    (``kwargs['input_ids']``), its last component (``input_ids``; ``keys`` for
    ``kwargs['cache'].layers[0].keys``), or a glob on the full name (``*keys``)."""
    if pattern == name or fnmatch.fnmatchcase(name, pattern):
        return True
    parts = [p for p in re.split(r"[.\[\]'\"]+", name) if p]
    return bool(parts) and parts[-1] == pattern


def named_input_gears(
    names: Sequence[str], example_inputs: Sequence[Any], input_gears: Mapping[str, Mapping[int, list[int]]]
) -> dict[int, dict[int, list[int]]]:
    """``{input index: {dim: gears}}`` for the tensor inputs ``input_gears`` names.

    A dim out of range for a named tensor raises :class:`graphgear.GearError`; names
    that match no input of this graph are left alone (a model compiles into several
    graphs, each with some of the inputs)."""
    out: dict[int, dict[int, list[int]]] = {}
    if not input_gears:
        return out
    for i, (name, x) in enumerate(zip(names, example_inputs)):
        if not isinstance(x, torch.Tensor):
            continue
        for pattern, dims in input_gears.items():
            if not input_name_matches(pattern, name):
                continue
            for dim, sizes in dims.items():
                if not -x.dim() <= dim < x.dim():
                    raise GearError(
                        f"graphgear: inference_config.input_gears[{pattern!r}] names dim {dim} of "
                        f"input {name!r}, which has {x.dim()} dims (allowed: {-x.dim()}..{x.dim() - 1}); "
                        f"fix the dim, or the name so that it matches only the inputs you mean."
                    )
                out.setdefault(i, {})[dim % x.dim()] = list(sizes)
    return out


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
    name = re.sub(r"\._(?:modules|parameters|buffers)\['([^']+)'\]", r".\1", name)
    name = re.sub(r"^[LG]\['([^']+)'\]", r"\1", name)
    return name


def aot_input_positions(gm: fx.GraphModule, num_inputs: int) -> dict[int, int]:
    """``{dynamo input index: AOT placeholder index}`` for the inputs an AOT forward or
    inference graph takes as they are (a plain tensor or a SymInt).

    AOTAutograd puts what it adds (parameters it lifts, effect tokens) in front of the
    inputs it was given, and flattens a tensor-subclass input (a DTensor parameter) into
    its inner tensors in place, so the graph can have more placeholders than dynamo had
    inputs, not only at the front. Each placeholder's AOT descriptor says which input it
    holds (:func:`graphgear._torch.aot.aot_input_source`); a subclass input has no entry here
    (its graph inputs are its inner tensors). Without descriptors (another torch), the
    inputs are counted from the end, as TorchAir does (``inputs[i - len(example_inputs)]``)."""
    placeholders, sources = _aot_sources(gm)
    if sources is not None:
        return {s[0]: j for j, s in enumerate(sources) if s is not None and not s[1] and s[0] < num_inputs}
    added = len(placeholders) - num_inputs
    if added < 0:
        return {}
    return {i: i + added for i in range(num_inputs)}


def _aot_sources(gm: fx.GraphModule) -> tuple[list[fx.Node], list[Any] | None]:
    """The graph's placeholders and each one's AOT input source
    (:func:`graphgear._torch.aot.aot_input_source`), or None where no placeholder has one
    (a torch without descriptors)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    sources = [aot_input_source(p) for p in placeholders]
    return placeholders, sources if any(s is not None for s in sources) else None


def aot_input_names(gm: fx.GraphModule, names: Sequence[str]) -> list[str]:
    """A name for every placeholder of an AOT forward or inference graph: the user's name
    of the dynamo input it holds (``names``, one per dynamo input), with the attribute
    for an inner tensor of a flattened subclass (``self.q_proj.weight._local_tensor``),
    and the placeholder's own name for what AOTAutograd added (``arg0_1``)."""
    placeholders, sources = _aot_sources(gm)
    if sources is None:
        added = len(placeholders) - len(names)
        if added < 0:
            return [p.name for p in placeholders]
        return [p.name for p in placeholders[:added]] + list(names)
    out = []
    for p, s in zip(placeholders, sources):
        if s is None or s[0] >= len(names):
            out.append(p.name)
            continue
        name, path = names[s[0]], list(s[1])
        while path:
            attr = path.pop(0)
            if attr in ("size", "stride") and path:
                name += f".{attr}()[{path.pop(0)}]"
            else:
                name += f".{attr}"
        out.append(name)
    return out


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
    for i, a in enumerate(op_schema(node.target).arguments):
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

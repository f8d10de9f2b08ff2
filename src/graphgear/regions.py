"""Repeated regions: a model's identical layers traced and compiled once.

Dynamo hands the backend one flat graph in which each of a model's N decoder layers
appears again, op for op. :func:`outline_repeated_regions` finds them (the nodes of
each child of a ``ModuleList`` or ``Sequential``, from dynamo's ``nn_module_stack``),
checks that the regions of one group are the same code (the same ops on inputs of
the same shapes, dtypes and strides, with the same constants), and replaces each by a
call of one shared subgraph (``invoke_subgraph``, what
``torch.compiler.nested_compile_region`` makes). AOTAutograd then traces the layer
once and Inductor generates its code once, so compile time stops growing with the
number of layers. Weights, KV-cache tensors and activations are the subgraph's
operands; nothing is assumed about them.

A region is left as it is (and the reason logged) when its nodes are not contiguous,
when it sets global state (grad mode, autocast), reads module attributes, or returns
anything but tensors. Graphs whose every region is left get nothing outlined.

Where piecewise capture must cut inside a region (an op it cannot capture), the
compiler raises :class:`RegionsRefused` and the backend compiles the graph again with
every region on its own. Training graphs are not outlined (see ``backend._outlines``).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import re
from typing import Any

import torch
from torch import fx

from ._torch.dynamo import copy_dynamo_graph
from ._torch.fx import INVOKE_SUBGRAPH
from ._torch.ops import HigherOrderOperator, OpOverload, OpOverloadPacket

log = logging.getLogger(__name__)

__all__ = ["MIN_REGION_NODES", "Region", "RegionsRefused", "outline_repeated_regions", "region_counts",
           "region_subgraphs"]

#: regions of fewer ops than this are not worth a subgraph call
MIN_REGION_NODES = 4

#: the prefix of the subgraphs graphgear adds (``graphgear_region_0``, ...)
PREFIX = "graphgear_region_"

# a module path that ends in a child index: "G['lm'].model.layers.3", "...layers[3]"
_INDEXED = re.compile(r"^(?P<parent>.+?)(?:\.|\[)(?P<index>\d+)\]?$")


class RegionsRefused(Exception):
    """A compiler cannot take this graph's shared subgraphs (piecewise capture must cut
    inside one): the backend compiles the graph again with every region on its own."""


@dataclasses.dataclass
class Region:
    """One child module's nodes in the graph, contiguous, with what flows in and out."""

    path: str
    cls: str
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    signature: Any = None


def _region_key(node: fx.Node) -> tuple[str, str] | None:
    """(path, class name) of the outermost indexed module ``node`` was traced in."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    for value in stack.values():
        path, cls = value[0], value[1]
        if _INDEXED.match(str(path)):
            return str(path), getattr(cls, "__qualname__", str(cls))
    return None


def _sets_state(node: fx.Node) -> bool:
    """A node that changes global state or reads the module (not an op on tensors)."""
    if node.op in ("get_attr", "call_module"):
        return True
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, OpOverload | OpOverloadPacket):
        return False
    if isinstance(target, HigherOrderOperator):
        return True  # already a subgraph (a nested region, a wrap): left as it is
    name = getattr(target, "__name__", "")
    return name.startswith("_") and target is not operator.getitem


def _find_regions(gm: fx.GraphModule) -> list[Region]:
    """Every child-module region of ``gm`` that could be outlined, in graph order."""
    runs: dict[tuple[str, str], list[list[fx.Node]]] = {}
    current: tuple[str, str] | None = None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            current = None
            continue
        key = _region_key(node)
        if key is None:
            current = None
            continue
        if key != current:
            runs.setdefault(key, []).append([])
            current = key
        runs[key][-1].append(node)
    regions = []
    for (path, cls), parts in runs.items():
        if len(parts) != 1:
            log.debug("graphgear: region %s left whole: its ops are not contiguous", path)
            continue
        nodes = parts[0]
        if len(nodes) < MIN_REGION_NODES or any(_sets_state(n) for n in nodes):
            continue
        inside = set(nodes)
        inputs: list[fx.Node] = []
        for n in nodes:
            for a in n.all_input_nodes:
                if a not in inside and a not in inputs:
                    inputs.append(a)
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        if not all(isinstance(n.meta.get("example_value"), torch.Tensor) for n in outputs):
            continue  # a size or a Python value leaves the region: not a tensor subgraph
        regions.append(Region(path, cls, nodes, inputs, outputs))
    return regions


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(map(str, value.shape)), tuple(map(str, value.stride())), value.dtype,
                value.device, value.requires_grad, str(value.storage_offset()))
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return ("sym", str(value))
    return ("value", type(value).__name__, repr(value))


def _constant(value: Any) -> Any:
    """A hashable stand-in for an argument that is not a node: equal only for equal values."""
    if isinstance(value, list | tuple):
        return (type(value).__name__, *(_constant(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, _constant(v)) for k, v in value.items()))
    if isinstance(value, slice):
        return ("slice", _constant(value.start), _constant(value.stop), _constant(value.step))
    if value is None or isinstance(value, bool | int | float | str | complex | torch.dtype | torch.device
                                   | torch.memory_format | torch.layout):
        return (type(value).__name__, value)
    return ("object", id(value))  # anything else: the same object only


def _signature(region: Region) -> Any:
    """What must be equal for two regions to be the same code."""
    index = {n: ("in", i) for i, n in enumerate(region.inputs)}
    index.update({n: ("op", i) for i, n in enumerate(region.nodes)})

    def arg(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return index[a]
        if isinstance(a, list | tuple):
            return (type(a).__name__, *(arg(v) for v in a))
        if isinstance(a, dict):
            return ("dict", *((k, arg(v)) for k, v in a.items()))
        return _constant(a)

    ops = tuple((n.op, n.target if n.op == "call_function" else str(n.target), arg(n.args), arg(n.kwargs))
                for n in region.nodes)
    inputs = tuple(_meta(n.meta.get("example_value")) for n in region.inputs)
    outputs = tuple(region.nodes.index(n) for n in region.outputs)
    return ops, inputs, outputs


def _subgraph(gm: fx.GraphModule, region: Region, renamed: dict[fx.Node, fx.Node]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, n in enumerate(region.inputs):
        p = graph.placeholder(f"arg{i}")
        p.meta.update(n.meta)
        env[renamed.get(n, n)] = p
    for n in region.nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[n] for n in region.outputs))
    return fx.GraphModule(gm, graph)


def outline_repeated_regions(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[str, int]]:
    """A copy of dynamo's graph ``gm`` with each group of identical child-module regions
    replaced by calls of one shared subgraph, and ``{subgraph name: calls}``; ``gm``
    itself and ``{}`` when nothing repeats."""
    copied = copy_dynamo_graph(gm)
    made = _outline(copied)
    return (copied, made) if made else (gm, made)


def _outline(gm: fx.GraphModule) -> dict[str, int]:
    groups: dict[Any, list[Region]] = {}
    for region in _find_regions(gm):
        try:
            region.signature = _signature(region)
            hash(region.signature)
        except (KeyError, TypeError):
            log.debug("graphgear: region %s left whole: its arguments cannot be compared", region.path)
            continue
        groups.setdefault((region.cls, region.signature), []).append(region)
    made: dict[str, int] = {}
    renamed: dict[fx.Node, fx.Node] = {}  # an outlined region's outputs: their getitem
    for (cls, _), members in groups.items():
        if len(members) < 2:
            continue
        name = f"{PREFIX}{re.sub(r'[^0-9A-Za-z_]', '_', cls)}_{len(made)}"
        while hasattr(gm, name):
            name += "_"
        gm.add_submodule(name, _subgraph(gm, members[0], renamed))
        for region in members:
            _replace(gm, region, name, renamed)
        made[name] = len(members)
        log.info("graphgear: %d regions of %s (%d ops each) share one subgraph, %s",
                 len(members), cls, len(members[0].nodes), name)
    if made:
        gm.graph.lint()
        gm.recompile()
    return made


def _replace(gm: fx.GraphModule, region: Region, name: str, renamed: dict[fx.Node, fx.Node]) -> None:
    graph = gm.graph
    inputs = [renamed.get(n, n) for n in region.inputs]
    inside = set(region.nodes)
    with graph.inserting_before(region.nodes[0]):
        sub = graph.get_attr(name)
        call = graph.call_function(INVOKE_SUBGRAPH, (sub, name, *inputs))
        call.meta["nn_module_stack"] = region.nodes[0].meta.get("nn_module_stack", {})
        call.meta["example_value"] = tuple(n.meta.get("example_value") for n in region.outputs)
        for i, out in enumerate(region.outputs):
            got = graph.call_function(operator.getitem, (call, i))
            got.meta.update(out.meta)
            renamed[out] = got
            out.replace_all_uses_with(got, delete_user_cb=lambda u: u not in inside)
    for n in reversed(region.nodes):
        graph.erase_node(n)


def region_subgraphs(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The subgraph modules the shared-subgraph calls of (aten) graph ``gm`` run, each
    once: the plain calls' and those AOTAutograd wrapped in ``auto_functionalized_v2``
    (a subgraph that writes its inputs, as a KV-cache update)."""
    subs: dict[int, fx.GraphModule] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        holder = None
        if n.target is INVOKE_SUBGRAPH:
            holder = n.args[0]
        elif n.args and n.args[0] is INVOKE_SUBGRAPH:
            holder = n.kwargs.get("subgraph")
        if isinstance(holder, fx.Node) and holder.op == "get_attr":
            sub = _attr(gm, str(holder.target))
            if isinstance(sub, fx.GraphModule):
                subs.setdefault(id(sub), sub)
    return list(subs.values())


def region_counts(gm: fx.GraphModule) -> dict[str, int]:
    """``{module class_index: calls}`` of the shared subgraphs in (aten) graph ``gm``
    (``{"Qwen2DecoderLayer_0": 24}``)."""
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is INVOKE_SUBGRAPH:
            name = str(n.args[1])
        elif n.args and n.args[0] is INVOKE_SUBGRAPH:
            name = str(n.kwargs.get("identifier", "?"))
        else:
            continue
        name = re.sub(rf"^(auto_functionalized_)?{PREFIX}", "", name)  # class_index
        counts[name] = counts.get(name, 0) + 1
    return counts


def _attr(module: Any, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part)
    return module

"""Piecewise capture's graph split: where a static graph is cut, and the pieces.

A *split node* runs uncaptured between the captured pieces: a node of an op named in
``capture_config.split_ops``, or (``split_uncapturable``) one that :func:`find_uncapturable
<graphgear.capture.rules.find_uncapturable>` flags and that splitting can serve (a host
read, a data-dependent shape, a random draw outside CUDA, a host side effect), together
with the nodes that read what such a node returns to the host (an unbacked int).
:func:`split_points` finds them; :func:`split_graph` cuts the graph into
:class:`Segment`\\ s in graph order: maximal runs of other nodes (the pieces, captured)
and runs of split nodes (run as they are).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from .._torch.ops import auto_functionalized_in_place, auto_functionalized_op, auto_functionalized_writes
from .._torch.storage import has_storage, storage_id
from ..debug import op_key
from .rules import find_uncapturable, node_uncapturable

__all__ = ["SplitPoints", "Segment", "absent_split_ops", "is_split_op", "rewire_split_ints", "split_graph", "split_int_inputs",
           "split_op_names", "split_points", "split_target", "writes_in_place"]

#: uncapturable reasons a split cannot serve: the graph itself changes with the data
_UNSPLITTABLE = ("control flow",)


def split_op_names(names: Iterable[str]) -> set[str]:
    """The op keys (``aten.add``, ``mylib.paged_attention``) of ``capture_config.split_ops``
    entries, which may name an overload (``aten.add.Tensor``), a packet, or use the
    ``namespace::op`` spelling of ``torch.library``."""
    out: set[str] = set()
    for name in names:
        key = name.replace("::", ".")
        parts = key.split(".")
        out.add(key)
        if len(parts) >= 3:  # an overload named: match its packet too
            out.add(".".join(parts[:2]))
    return out


def is_split_op(config: Any, target: Any) -> bool:
    """Whether ``config`` (reduce-overhead, piecewise) cuts graphs at op ``target``:
    graphgear's passes then leave its nodes as they are, so the cut finds them."""
    cc = config.capture_config
    if config.mode != "reduce-overhead" or cc.mode == "full" or not cc.split_ops:
        return False
    keys = split_op_names(cc.split_ops)
    key = op_key(target)
    return key in keys or f"{key}.{getattr(target, '_overloadname', '')}" in keys


def split_target(node: fx.Node) -> Any:
    """The op ``node`` calls, as ``split_ops`` names it: for a ``torch.library`` op that
    writes an input, the op inside the ``auto_functionalized(_v2)`` call AOTAutograd
    wraps it in (its first argument), else the node's target."""
    if node.op != "call_function":
        return node.target
    return auto_functionalized_op(node.target, node.args, dict(node.kwargs)) or node.target


def _matches(node: fx.Node, keys: set[str]) -> bool:
    if node.op != "call_function":
        return False
    target = split_target(node)
    key = op_key(target)
    if key in keys:
        return True
    overload = getattr(target, "_overloadname", None)
    return overload is not None and f"{key}.{overload}" in keys


def absent_split_ops(gm: fx.GraphModule, names: Sequence[str]) -> list[str]:
    """The entries of ``names`` (``split_ops``) that match no node of ``gm``."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    return [name for name in names if not any(_matches(n, split_op_names([name])) for n in nodes)]


@dataclasses.dataclass
class SplitPoints:
    """Where one graph is cut (``nodes``, with ``(op, why)`` per distinct op in ``why``)
    and what cannot be served by a cut (``blocked``: the whole graph falls back)."""

    nodes: set[fx.Node] = dataclasses.field(default_factory=set)
    why: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    blocked: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def add(self, node: fx.Node, why: str) -> None:
        self.nodes.add(node)
        entry = (op_key(split_target(node)), why)
        if entry not in self.why:
            self.why.append(entry)


def _reads_unbacked(node: fx.Node) -> str | None:
    """Why ``node`` must run uncaptured for what it reads (None: it need not): a value
    read back to the host (the unbacked int of ``.item()``), or a tensor whose shape,
    strides or offset depend on the data (``x[:k]``, ``nonzero``'s result). A capture would
    freeze that size at its first value: a ``sum`` over ``x[:k]`` replayed with the ``k``
    of the capture."""
    for a in node.all_input_nodes:
        v = a.meta.get("val")
        try:
            unbacked = v is not None and bool(free_unbacked_symbols(v))
        except Exception:  # a value free_unbacked_symbols cannot walk: no symbol to find
            unbacked = False
        if not unbacked:
            continue
        if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
            return "reads a value the graph computed on the host"
        return "reads a tensor whose shape depends on the data"
    return None


def split_points(gm: fx.GraphModule, device: torch.device, *, split_ops: Sequence[str],
                 split_uncapturable: bool) -> SplitPoints:
    """The split nodes of ``gm`` on ``device`` (see the module docstring)."""
    points = SplitPoints()
    keys = split_op_names(split_ops)
    for n in gm.graph.nodes:
        if keys and _matches(n, keys):
            points.add(n, "listed in capture_config.split_ops")
    if not split_uncapturable:
        points.blocked = find_uncapturable(gm, device)
        return points
    for n in gm.graph.nodes:
        if n.op != "call_function" or n in points.nodes:
            continue
        why = node_uncapturable(n, device)
        if why is None:
            why = _reads_unbacked(n)
            if why is None and any(u in points.nodes and u.target is operator.getitem
                                   for u in n.all_input_nodes):
                why = "reads a value the graph computed on the host"
            if why is not None:
                points.add(n, why)
            continue
        if why.startswith(_UNSPLITTABLE):
            points.blocked.append((op_key(n.target), why))
        else:
            points.add(n, why)
    return points


def writes_in_place(gm: fx.GraphModule, split: set[fx.Node]) -> tuple[fx.GraphModule, set[fx.Node]]:
    """``gm`` (a copy, where anything changes) with its split nodes of ``torch.library``
    ops that write an input run on that input itself, and ``split`` mapped to it.

    AOTAutograd holds such an op as ``auto_functionalized(_v2)``: the op writes clones,
    later nodes read the clones, and a ``copy_`` at the end of the graph writes them
    back. Inside a compiled graph Inductor undoes that; a split node runs as it is, so
    it would clone the whole buffer (a KV cache) on every call. Here, where no node after
    the split node reads the old values (other than the ``copy_`` back, which then goes)
    and the graph does not return the new ones, the split node writes the real tensor
    and the nodes after it read that tensor. Elsewhere it stays as it is (right, with
    the clone)."""
    if not any(auto_functionalized_writes(n.target, n.args, dict(n.kwargs)) for n in split):
        return gm, split
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    new_gm = fx.GraphModule(gm, graph)
    split = {env[n] for n in split}
    changed = False
    for n in list(graph.nodes):
        if n not in split:
            continue
        writes = auto_functionalized_writes(n.target, n.args, dict(n.kwargs))
        if not writes or not _can_write_in_place(graph, n, writes):
            continue
        news = {u.args[1]: u for u in n.users if u.target is operator.getitem}
        for index, base in writes:
            new = news.get(index)
            if new is None:
                continue
            for u in list(new.users):
                if _is_copy_back(u, base, new):
                    u.replace_all_uses_with(base)
                    graph.erase_node(u)
            new.replace_all_uses_with(base)
            split.discard(new)
            graph.erase_node(new)
        n.target = auto_functionalized_in_place(n.target)
        changed = True
    if not changed:
        return gm, {n for n in gm.graph.nodes if env.get(n) in split}
    new_gm.recompile()
    return new_gm, split


def _is_copy_back(node: fx.Node, base: fx.Node, new: fx.Node) -> bool:
    return (node.op == "call_function" and op_key(node.target) == "aten.copy_"
            and len(node.args) >= 2 and node.args[0] is base and node.args[1] is new)


def _storage(node: fx.Node) -> int | None:
    """The storage ``node``'s tensor value lies in (None: not a tensor)."""
    v = node.meta.get("val")
    if not isinstance(v, torch.Tensor) or not has_storage(v):
        return None
    return storage_id(v.untyped_storage())


def _view_root(node: fx.Node) -> fx.Node:
    """The node whose memory ``node`` views (itself where it views nothing)."""
    while (node.op == "call_function" and getattr(node.target, "is_view", False) and node.args
           and isinstance(node.args[0], fx.Node)):
        node = node.args[0]
    return node


def _can_write_in_place(graph: fx.Graph, node: fx.Node, writes: list[tuple[int, Any]]) -> bool:
    """Whether ``node`` (``auto_functionalized(_v2)``) may write ``writes`` themselves:
    no node after it reads the memory of one before its new value (a ``copy_`` into it
    writes it, it does not read it), nor returns a new value or what views it."""
    if not all(isinstance(b, fx.Node) and "val" in b.meta and _storage(b) is not None for _, b in writes):
        return False
    old = {_storage(b) for _, b in writes}
    roots = {_view_root(b) for _, b in writes}
    news = [u for u in node.users if u.target is operator.getitem]
    fresh = {_storage(u) for u in news} - {None}
    after = False
    for n in graph.nodes:
        if n is node:
            after = True
            continue
        if not after or n in news:
            continue
        reads = list(n.all_input_nodes)
        if op_key(n.target) == "aten.copy_" and n.args and n.args[0] in reads:
            reads.remove(n.args[0])  # the destination of a copy is written, not read
        for a in reads:
            if a is node or a in news:
                if n.op == "output":
                    return False
                continue
            if "val" not in a.meta:
                # an input of no known value (a Python int of the call, rewired after
                # specialisation): AOTAutograd's inputs do not overlap, so only the
                # input a written tensor views can hold its memory
                if a.op == "placeholder" and a not in roots:
                    continue
                return False
            sid = _storage(a)
            if sid is not None and (sid in old or (n.op == "output" and sid in fresh)):
                return False
    return True


@dataclasses.dataclass
class Segment:
    """One run of nodes of the split graph: its own graph (``gm``), the parent graph's
    values it reads (``inputs``) and the ones it defines that later segments or the
    graph's output read (``outputs``). ``captured`` False: split nodes, run as they are."""

    gm: fx.GraphModule
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    captured: bool
    ops: list[str]


def split_graph(gm: fx.GraphModule, split: set[fx.Node]) -> list[Segment]:
    """``gm`` cut into segments at the nodes of ``split`` (see the module docstring);
    a ``getitem`` of a split node's result stays with it."""
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    runs: list[tuple[bool, list[fx.Node]]] = []
    for n in body:
        cut = n in split or (n.target is operator.getitem and n.args[0] in split)
        if cut:
            split.add(n)
        if not runs or runs[-1][0] != (not cut):
            runs.append((not cut, []))
        runs[-1][1].append(n)
    # a run of views, getitems and constants alone is not worth a capture: run it as it is
    runs = [(cap and any(_computes(n) for n in nodes), nodes) for cap, nodes in runs]
    merged: list[tuple[bool, list[fx.Node]]] = []
    for cap, nodes in runs:
        if merged and merged[-1][0] == cap:
            merged[-1][1].extend(nodes)
        else:
            merged.append((cap, list(nodes)))
    position = {n: i for i, (_, nodes) in enumerate(merged) for n in nodes}
    output = next(iter(gm.graph.find_nodes(op="output")))
    segments = []
    for i, (cap, nodes) in enumerate(merged):
        members = set(nodes)
        inputs: list[fx.Node] = []
        for n in nodes:
            for a in n.all_input_nodes:
                if a not in members and a not in inputs:
                    inputs.append(a)
        outputs = [n for n in nodes
                   if any(u is output or position.get(u, -1) > i for u in n.users)]
        segments.append(Segment(_subgraph(gm, nodes, inputs, outputs), inputs, outputs, cap,
                                sorted({op_key(n.target) for n in nodes if n.op == "call_function"})))
    return segments


def _computes(n: fx.Node) -> bool:
    """Whether ``n`` does work a capture saves (not a view, a getitem or a constant)."""
    if n.op != "call_function" or n.target is operator.getitem:
        return False
    schema = getattr(n.target, "_schema", None)
    if schema is not None and schema.returns and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        return False  # a view
    return True


def _subgraph(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node],
              outputs: list[fx.Node]) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        p = g.placeholder(a.name)
        p.meta = dict(a.meta)
        env[a] = p
    for n in nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[n] for n in outputs))
    return fx.GraphModule(gm, g)


def split_int_inputs(gm: fx.GraphModule, split_ops: Sequence[str]) -> list[int]:
    """Indices of ``gm``'s Python-int placeholders (SymInts) that only split nodes of
    ``split_ops`` read, each as a plain argument: a sequence length passed to a
    custom attention op. A piecewise graph passes them on at their value of each call,
    so they are no part of its graph key."""
    keys = split_op_names(split_ops)
    if not keys:
        return []
    out = []
    for i, p in enumerate(gm.graph.find_nodes(op="placeholder")):
        if isinstance(p.meta.get("val"), torch.SymInt) and p.users and all(
                _matches(u, keys) and p not in _nested_args(u) for u in p.users):
            out.append(i)
    return out


def _nested_args(node: fx.Node) -> set[fx.Node]:
    """The nodes ``node`` reads inside a list or tuple argument (not as a plain one)."""
    out: set[fx.Node] = set()
    for a in (*node.args, *node.kwargs.values()):
        if isinstance(a, list | tuple):
            out |= {x for x in a if isinstance(x, fx.Node)}
    return out


def rewire_split_ints(static: fx.GraphModule, dynamic: fx.GraphModule, idx: Sequence[int],
                      split_ops: Sequence[str]) -> None:
    """In ``static`` (``dynamic`` specialised to one graph key), give the split nodes the
    Python-int placeholders ``idx`` (:func:`split_int_inputs`) back where ``dynamic``'s
    split nodes read them: the specialisation made them constants. The split nodes of
    both graphs are the same calls in the same order."""
    if not idx:
        return
    keys = split_op_names(split_ops)
    dyn_ph = list(dynamic.graph.find_nodes(op="placeholder"))
    st_ph = list(static.graph.find_nodes(op="placeholder"))
    wanted = {dyn_ph[i]: st_ph[i] for i in idx}
    dyn_nodes = [n for n in dynamic.graph.nodes if _matches(n, keys)]
    st_nodes = [n for n in static.graph.nodes if _matches(n, keys)]
    if [n.target for n in dyn_nodes] != [n.target for n in st_nodes]:
        raise RuntimeError(
            f"graphgear: the split ops of a graph differ after its specialisation "
            f"({[op_key(n.target) for n in dyn_nodes]} vs {[op_key(n.target) for n in st_nodes]}); "
            f"this is a graphgear bug: report it with the graph dump (debug.graph_dump)."
        )
    for d, s in zip(dyn_nodes, st_nodes):
        s.args = tuple(wanted.get(a, b) if isinstance(a, fx.Node) else b for a, b in zip(d.args, s.args))
        s.kwargs = {k: wanted.get(d.kwargs.get(k), v) if isinstance(d.kwargs.get(k), fx.Node) else v
                    for k, v in s.kwargs.items()}
    static.recompile()


def segment_values(segments: Sequence[Segment], placeholders: Sequence[fx.Node]) -> dict[fx.Node, int]:
    """A slot per value the segments pass on: the graph's inputs first, then each
    segment's outputs in order."""
    slots = {p: i for i, p in enumerate(placeholders)}
    for seg in segments:
        for n in seg.outputs:
            slots[n] = len(slots)
    return slots


def graph_output(gm: fx.GraphModule) -> Any:
    return next(iter(gm.graph.find_nodes(op="output"))).args[0]

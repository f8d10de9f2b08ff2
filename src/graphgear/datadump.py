"""``debug.data_dump``: each selected node's output, per call, for accuracy work.

With ``debug.data_dump.enabled`` the pipeline hands a graph to :class:`DataDumper`
instead of the mode's compiler: each call runs the graph op by op (an FX interpreter: no
Inductor, no capture, no gear check) and, on the calls ``steps`` selects, keeps the
output of every node ``ops`` and ``nodes`` select. ``stage`` picks the graph: the
``"original"`` one as AOTAutograd gives it (the mode's decompositions applied, none of
graphgear's passes) or the ``"optimized"`` one after graphgear's passes (what the mode
compiles). Layout, one folder per graph under ``path``::

    <path>/<graph>/call_00000.pt   # {node name: tensor}; torch.load(f, weights_only=True)
    <path>/<graph>/index.json      # the graph, stage and mode; per node its op and source
                                   # line; per call and node: shape, dtype and stats

Tensors are saved detached, contiguous and on the CPU. Files are written as the graph
dumps are (:func:`graphgear.debug.write_dump`: never through a symlink; a failure warns
and never stops the call). Off (the default) nothing of this runs: the check is made once,
at compile time.
"""

from __future__ import annotations

import fnmatch
import io
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from .dumpfiles import make_folder, op_key, write_dump

if TYPE_CHECKING:
    from .config import CompilerConfig

log = logging.getLogger(__name__)

__all__ = ["INDEX", "DataDumper", "copy_graph", "dumped_compiler", "source_line", "tensor_stats"]

#: the index file of each graph folder
INDEX = "index.json"


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose graph passes can rewrite without touching ``gm``'s (node
    metadata is shared, not copied)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


def source_line(node: fx.Node) -> str:
    """The user's source line a node came from (the last frame of its FX stack trace):
    ``file:line in function: code``; ``""`` where the node has none."""
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("File "):
            parts = lines[i][5:].split(", ")
            where = parts[0].strip('"')
            line = parts[1].replace("line ", "") if len(parts) > 1 else "?"
            fn = parts[2].replace("in ", "") if len(parts) > 2 else "?"
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            return f"{where}:{line} in {fn}: {code}".rstrip(": ")
    return ""


def tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    """Shape, dtype and summary statistics of ``t`` (plain data, for the index)."""
    out: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
    if t.numel() == 0 or t.is_complex():
        return out
    if t.dtype.is_floating_point:
        v = t.detach().double()
        finite = v[torch.isfinite(v)]
        out.update(nan=int(torch.isnan(v).sum()), inf=int(torch.isinf(v).sum()))
        if finite.numel():
            out.update(min=float(finite.min()), max=float(finite.max()), mean=float(finite.mean()),
                       abs_mean=float(finite.abs().mean()))
    elif t.dtype != torch.bool:
        out.update(min=int(t.min()), max=int(t.max()))
    return out


def _selected(node: fx.Node, ops: Sequence[str], names: Sequence[str]) -> bool:
    if node.op not in ("call_function", "placeholder"):
        return False
    if ops:
        if node.op != "call_function":
            return False
        if op_key(node.target) not in ops and str(node.target) not in ops:
            return False
    return not names or any(fnmatch.fnmatchcase(node.name, g) for g in names)


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, keep: set[str]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.keep = keep
        self.kept: dict[str, torch.Tensor] = {}

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        if n.name in self.keep and isinstance(value, torch.Tensor):
            self.kept[n.name] = value.detach().to("cpu", copy=True).contiguous()
        return value


class DataDumper:
    """Runs one graph op by op, dumping the selected nodes' outputs (module docstring);
    called as ``fn(*args)``."""

    def __init__(self, gm: fx.GraphModule, config: CompilerConfig, graph_name: str, mode: str) -> None:
        dump = config.debug.data_dump
        self.gm = gm
        self.folder = os.path.join(dump.path, graph_name)
        self.steps = set(dump.steps)
        nodes = [n for n in gm.graph.nodes if _selected(n, dump.ops, dump.nodes)]
        self.keep = {n.name for n in nodes}
        self.index: dict[str, Any] = {
            "graph": graph_name, "stage": dump.stage, "mode": mode,
            "nodes": [{"name": n.name, "op": "input" if n.op == "placeholder" else op_key(n.target),
                       "target": str(n.target), "source": source_line(n)} for n in nodes],
            "calls": [],
        }
        self.calls = 0
        self._lock = threading.Lock()
        self._ok = make_folder(self.folder)

    def __call__(self, *args: Any) -> Any:
        with self._lock:
            call = self.calls
            self.calls += 1
        if not self._ok or (self.steps and call not in self.steps):
            return self.gm(*args)
        rec = _Recorder(self.gm, self.keep)
        out = rec.run(*args)
        name = f"call_{call:05d}.pt"
        buf = io.BytesIO()
        torch.save(rec.kept, buf)
        if write_dump(os.path.join(self.folder, name), buf.getvalue()):
            entry = {"call": call, "file": name, "tensors": {k: tensor_stats(v) for k, v in rec.kept.items()}}
            with self._lock:  # written under the lock: a thread's older index never lands last
                self.index["calls"].append(entry)
                self.index["calls"].sort(key=lambda c: c["call"])
                write_dump(os.path.join(self.folder, INDEX), json.dumps(self.index, indent=1))
            log.info("graphgear: data dump of %s call %d: %d tensors in %s", self.index["graph"], call,
                     len(rec.kept), self.folder)
        return out


def dumped_compiler(gm: fx.GraphModule, original: fx.GraphModule | None, config: CompilerConfig,
                    graph_name: str, mode: str) -> Callable[..., Any]:
    """The callable a dumped graph runs as: ``original`` (the graph before the passes)
    at stage ``"original"``, else ``gm``."""
    stage = config.debug.data_dump.stage
    return DataDumper(original if stage == "original" and original is not None else gm, config, graph_name, mode)

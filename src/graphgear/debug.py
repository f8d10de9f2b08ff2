"""Graph dumps (``debug.graph_dump``) and op summaries (``debug.fx_summary``).

Layout on disk: every file is named ``gg_<seq>_<graph>_<stage>.<ext>``, where ``seq``
is a five-digit counter shared by the whole process, so a plain ``ls`` sorts files in
the order graphgear produced them; ``graph`` is the record name (``graph_003_forward``)
and ``stage`` one of ``dynamo`` (the graph dynamo handed over), ``forward``,
``backward``, ``inference`` (the AOT graph as received), ``after_<pass>`` (after each
pass that changed something), ``final`` (what the mode compiles).

``txt`` is one row per node: opcode, name, target, args, kwargs (the layout of
``torch.fx.Graph.print_tabular``). ``py`` is the graph module's readable Python code.
``fx_summary`` writes ``gg_<seq>_<graph>_summary.csv`` with the columns
``op,count,supported,note``: every op target, how often it occurs, and whether the
chosen mode handles it natively (``yes``) or not (``no``, with the reason).

Data dumps (``debug.data_dump``, the node outputs of each call) are
:mod:`graphgear.datadump`'s; :func:`compare` and :func:`compare_dumps`
(:mod:`graphgear.accuracy`, also ``graphgear compare``) find the node whose output
diverged.

Dump names are predictable, so a file is never written through a name that is already
a symlink: such a name is left alone (a warning names it and the dump is skipped), and
every dump is written to a fresh temporary file in the same folder and then renamed
over the name (``os.replace`` replaces a link or file there, never the file a link
points to). A regular file from an earlier run is replaced. Failing to write a dump
logs a warning and never stops the compile.
"""

from __future__ import annotations

import collections
import csv
import io
import itertools
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import fx

from .accuracy import CompareReport, NodeDiff, compare, compare_dumps
from .dumpfiles import make_folder, op_key, target_name, text_table, write_dump

if TYPE_CHECKING:
    from .config import CompilerConfig

log = logging.getLogger(__name__)

__all__ = ["CompareReport", "NodeDiff", "compare", "compare_dumps", "dump_graph", "fx_summary", "make_folder",
           "op_key", "tabular", "text_table", "write_dump"]

_seq = itertools.count()
_seq_lock = threading.Lock()


def _next_seq() -> int:
    with _seq_lock:
        return next(_seq)


def tabular(graph: fx.Graph) -> str:
    """``Graph.print_tabular``'s table as a string, without the ``tabulate`` package."""
    header = ["opcode", "name", "target", "args", "kwargs"]
    rows = [[n.op, n.name, target_name(n.target), str(n.args), str(n.kwargs)] for n in graph.nodes]
    return text_table(header, rows) + "\n"


def dump_graph(gm: fx.GraphModule, config: CompilerConfig, graph_name: str, stage: str) -> str | None:
    """Write ``gm`` if ``debug.graph_dump.type`` is set; returns the file written."""
    kind = config.debug.graph_dump.type
    if kind is None:
        return None
    folder = config.debug.graph_dump.path
    if not make_folder(folder):
        return None
    path = os.path.join(folder, f"gg_{_next_seq():05d}_{graph_name}_{stage}.{kind}")
    text = tabular(gm.graph) if kind == "txt" else gm.print_readable(print_output=False)
    if not write_dump(path, text):
        return None
    log.debug("graphgear: dumped %s", path)
    return path


def fx_summary(gm: fx.GraphModule, config: CompilerConfig, graph_name: str,
               support: Callable[[object], tuple[bool, str]]) -> str | None:
    """Write the op summary CSV if ``debug.fx_summary.type`` is set; returns the file.
    ``support(target)`` says whether the mode handles an op natively, and why not."""
    if config.debug.fx_summary.type is None:
        return None
    counts: collections.Counter[str] = collections.Counter()
    targets: dict[str, object] = {}
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            key = op_key(n.target)
            counts[key] += 1
            targets.setdefault(key, n.target)
    folder = config.debug.fx_summary.path
    if not make_folder(folder):
        return None
    path = os.path.join(folder, f"gg_{_next_seq():05d}_{graph_name}_summary.csv")
    buf = io.StringIO(newline="")
    w = csv.writer(buf)
    w.writerow(["op", "count", "supported", "note"])
    for key, count in sorted(counts.items()):
        ok, note = support(targets[key])
        w.writerow([key, count, "yes" if ok else "no", note])
    return path if write_dump(path, buf.getvalue()) else None

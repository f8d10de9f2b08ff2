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
import stat
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from torch import fx

from ._torch.ops import OpOverload, OpOverloadPacket, op_name, op_packet_name

if TYPE_CHECKING:
    from .config import CompilerConfig

log = logging.getLogger(__name__)

_seq = itertools.count()
_seq_lock = threading.Lock()


def _next_seq() -> int:
    with _seq_lock:
        return next(_seq)


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, rule: bool = True) -> str:
    """Left-aligned columns two spaces apart; ``rule`` draws dashes under the header."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    if rule:
        lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def tabular(graph: fx.Graph) -> str:
    """``Graph.print_tabular``'s table as a string, without the ``tabulate`` package."""
    header = ["opcode", "name", "target", "args", "kwargs"]
    rows = [[n.op, n.name, _target_name(n.target), str(n.args), str(n.kwargs)] for n in graph.nodes]
    return text_table(header, rows) + "\n"


def _target_name(target: object) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, OpOverload | OpOverloadPacket):
        return str(target)
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)


def dump_graph(gm: fx.GraphModule, config: CompilerConfig, graph_name: str, stage: str) -> str | None:
    """Write ``gm`` if ``debug.graph_dump.type`` is set; returns the file written."""
    kind = config.debug.graph_dump.type
    if kind is None:
        return None
    folder = config.debug.graph_dump.path
    if not _make_folder(folder):
        return None
    path = os.path.join(folder, f"gg_{_next_seq():05d}_{graph_name}_{stage}.{kind}")
    text = tabular(gm.graph) if kind == "txt" else gm.print_readable(print_output=False)
    if not write_dump(path, text):
        return None
    log.debug("graphgear: dumped %s", path)
    return path


def write_dump(path: str, text: str) -> bool:
    """Write ``text`` to ``path`` without following a symlink there; ``False`` (with a
    warning naming the path and the reason) when it was not written.

    An existing symlink at ``path`` is refused. Otherwise the text goes to a new
    temporary file (``O_EXCL``, mode 0600) in the same folder, renamed over ``path``, so
    a link planted between the check and the rename is replaced, not followed.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("graphgear: debug dump %s not written: cannot check it (%s)", path, e.strerror)
        return False
    else:
        if stat.S_ISLNK(st.st_mode):
            log.warning("graphgear: debug dump %s not written: that name is a symlink (to %r); "
                        "graphgear does not write through links", path, _readlink(path))
            return False
        if not stat.S_ISREG(st.st_mode):
            log.warning("graphgear: debug dump %s not written: that name exists and is not a "
                        "regular file", path)
            return False
    folder, name = os.path.split(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder or ".")
        with open(fd, "w", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("graphgear: debug dump %s not written: %s", path, e.strerror or e)
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False
    return True


def _make_folder(folder: str) -> bool:
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        log.warning("graphgear: debug dumps not written to %s: cannot create it (%s)", folder, e.strerror or e)
        return False
    return True


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"


# Ops that read device data back to the host or produce data-dependent shapes: a
# device graph cannot hold them.
def op_key(target: object) -> str:
    """``aten.add`` for ``aten.add.Tensor``; the qualified name for other callables."""
    if isinstance(target, OpOverload):
        return op_name(target)
    if isinstance(target, OpOverloadPacket):
        return op_packet_name(target)
    return _target_name(target)


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
    if not _make_folder(folder):
        return None
    path = os.path.join(folder, f"gg_{_next_seq():05d}_{graph_name}_summary.csv")
    buf = io.StringIO(newline="")
    w = csv.writer(buf)
    w.writerow(["op", "count", "supported", "note"])
    for key, count in sorted(counts.items()):
        ok, note = support(targets[key])
        w.writerow([key, count, "yes" if ok else "no", note])
    return path if write_dump(path, buf.getvalue()) else None

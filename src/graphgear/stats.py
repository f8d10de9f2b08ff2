"""Per-graph statistics: what was compiled, captured, replayed, refused and why.

Every graph a graphgear compiler receives gets one :class:`GraphRecord`, appended to a
process-wide list in compile order. ``graphgear.stats()`` returns a snapshot of it;
``graphgear.reset()`` clears it and releases every compiled artifact that registered a
release hook.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .debug import text_table
from .errors import ConfigError, GraphgearError

if TYPE_CHECKING:
    from torch import fx

log = logging.getLogger(__name__)

__all__ = ["WARM_ACTIONS", "GraphRecord", "Stats", "WarmStats", "after_warm", "mark_warm", "graph_source", "new_record", "on_reset", "record_count", "records_since", "record_joint_passes", "register_release", "reset", "stats"]


@dataclasses.dataclass
class GraphRecord:
    """What graphgear knows about one compiled FX graph."""

    name: str
    stage: str  # "forward" | "backward" | "inference"
    mode: str  # "max-autotune" | "reduce-overhead" | "eager" (debug.run_eagerly)
    inputs: list[str] = dataclasses.field(default_factory=list)
    num_nodes: int = 0
    gears: list[tuple[int, ...]] = dataclasses.field(default_factory=list)
    compiles: int = 0
    captures: int = 0
    replays: int = 0
    fallbacks: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    compile_seconds: float = 0.0
    pool_bytes: int = 0
    passes: dict[str, int] = dataclasses.field(default_factory=dict)
    uncaptured_runs: int = 0
    rebinds: int = 0  # CPU graph: replays that rebound a moved input used in place (a new KV cache)
    recaptures: int = 0  # CUDA/NPU: captures (of the compiled code) for a moved input used in place
    cache: str = ""  # graphgear.cache: "hit" (loaded), "miss" (compiled, not stored), "stored",
    # "refused" (rebuilt from an entry that was then refused, not used), "unsupported" (torch's
    # precompile cannot save this function: served uncached, ``cache_reason`` says why); "" unused
    cache_reason: str = ""  # graphgear.cache: why a graph is "unsupported" or "refused"
    loaded_keys: int = 0  # graphgear.cache: graph keys whose compiled code was loaded, not compiled
    cache_load_seconds: float = 0.0  # graphgear.cache: seconds to check and load the entry (hits)
    # piecewise capture (capture_config.mode): the captured pieces (``capture.pieces.PieceRecord``:
    # name, ops, captures, replays, ... of each; this record's counters count pieces), and
    # the ops it is split at, with why
    pieces: list[Any] = dataclasses.field(default_factory=list)
    splits: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    # where the graph comes from: the function dynamo traced and the line of its first op
    # (``forward (modeling_qwen2.py:195)``; "" where the graph has no stack traces, as a
    # hand-built one): in a loop of many graphs it names each
    source: str = ""
    # repeated regions (graphgear.regions): calls of each shared subgraph, by its name
    regions: dict[str, int] = dataclasses.field(default_factory=dict)
    # seconds each graph key (gear) took to specialise and compile, by key
    key_seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def add_fallback(self, op: str, reason: str) -> None:
        if (op, reason) not in self.fallbacks:
            self.fallbacks.append((op, reason))

    def add_split(self, op: str, reason: str) -> None:
        if (op, reason) not in self.splits:
            self.splits.append((op, reason))

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(dataclasses.replace(self, pieces=[]))
        out["pieces"] = [p.as_dict() for p in self.pieces]
        return out


class Stats:
    """A snapshot of every :class:`GraphRecord`, in compile order, and of what the
    joint-graph fusion passes found (``joint``: one dict per run, oldest first)."""

    def __init__(self, graphs: list[GraphRecord], joint: list[dict[str, Any]] | None = None,
                 warm: WarmStats | None = None) -> None:
        self.graphs = graphs
        self.joint = joint or []
        self.warm = warm if warm is not None else WarmStats()

    def as_dict(self) -> dict[str, Any]:
        return {"graphs": [g.as_dict() for g in self.graphs], "joint": [dict(j) for j in self.joint],
                "warm": dataclasses.asdict(self.warm)}

    def __len__(self) -> int:
        return len(self.graphs)

    def __str__(self) -> str:
        cols = ["name", "stage", "mode", "gears", "compiles", "captures", "replays", "rebinds",
                "uncaptured", "pieces", "regions", "fallbacks", "compile_s", "pool_bytes", "cache", "source"]
        rows = [
            [g.name, g.stage, g.mode, str(len(g.gears)) if g.gears else "-", str(g.compiles),
             str(g.captures) + (f" ({g.recaptures} moved)" if g.recaptures else ""),
             str(g.replays), str(g.rebinds), str(g.uncaptured_runs),
             (f"{len(g.pieces)} (split at " + ", ".join(op for op, _ in g.splits) + ")") if g.pieces else "-",
             ", ".join(f"{n} x{c}" for n, c in g.regions.items()) or "-",
             "; ".join(f"{op}: {why}" for op, why in g.fallbacks) or "-",
             f"{g.compile_seconds:.3f}", str(g.pool_bytes), g.cache or "-", g.source or "-"]
            for g in self.graphs
        ]
        table = text_table(cols, rows, rule=False)
        return table if rows else table + "\n(no graphs compiled)"

    __repr__ = __str__


_lock = threading.Lock()
_records: list[GraphRecord] = []
_counter = itertools.count()
_releasers: list[weakref.ref[Any] | Callable[[], Any]] = []
_on_reset: list[Callable[[], None]] = []
_joint: list[dict[str, Any]] = []
_JOINT_MAX = 1000  # the latest are kept


# ---- the warm-up stance ---------------------------------------------------------------
# A server warms up (precompiles its gears, serves a few requests) and then must not
# compile while it serves: a compile in the middle of serving stalls every request behind
# it. After mark_warm(on_new), each new graph dynamo hands the backend, and each new graph
# key (a gear or shape: its compile and capture), is counted in stats().warm and warns,
# raises, or runs uncompiled. Process-wide, as torch.compiler.set_stance; reset() ends it.

#: what a new compile or capture does after :func:`mark_warm`
WARM_ACTIONS = ("warn", "raise", "eager")
_WARM_EVENTS_KEPT = 100


@dataclasses.dataclass
class WarmStats:
    """``stats().warm``: the stance (``on_new``; None when not marked warm) and what came
    after :func:`mark_warm`: new graphs (a graph dynamo handed the backend) and new keys (a
    gear or shape of a compiled graph: compiled and captured), each described in ``events``."""

    on_new: str | None = None
    new_graphs: int = 0
    new_keys: int = 0
    events: list[str] = dataclasses.field(default_factory=list)


_warm = [WarmStats()]  # one element: replaced whole under _lock


def mark_warm(on_new: str | None = "warn") -> None:
    """Warm-up is over: from now on a new compile or capture warns (``"warn"``), raises a
    :class:`~graphgear.errors.GraphgearError` (``"raise"``) or runs uncompiled and
    uncaptured (``"eager"``), and is counted in ``stats().warm``. ``None`` ends the stance
    (so does :func:`reset`)."""
    if on_new is not None and on_new not in WARM_ACTIONS:
        raise ConfigError(
            f"graphgear.mark_warm(on_new={on_new!r}): allowed values are "
            f"{', '.join(map(repr, WARM_ACTIONS))}, or None to end the stance.")
    with _lock:
        _warm[0] = WarmStats(on_new=on_new)


def after_warm(kind: str, what: str, fix: str) -> bool:
    """Note a new ``kind`` (``"graph"`` or ``"key"``) described by ``what``; True when the
    caller must run it uncompiled (``"eager"``). Raises under ``"raise"``; does nothing
    when the process is not marked warm. ``fix`` says how to avoid the event."""
    with _lock:
        w = _warm[0]
        if w.on_new is None:
            return False
        if kind == "graph":
            w.new_graphs += 1
        else:
            w.new_keys += 1
        w.events.append(what)
        del w.events[:-_WARM_EVENTS_KEPT]
        on_new = w.on_new
    new = "compile" if kind == "graph" else "compile and capture"
    message = f"graphgear: {what}: a new {new} after graphgear.mark_warm(). {fix}"
    if on_new == "raise":
        raise GraphgearError(f"{message} To let it compile instead: graphgear.mark_warm('warn').")
    if on_new == "eager":
        log.warning("%s It runs uncompiled (mark_warm('eager')).", message)
        return True
    log.warning("%s It compiles now (mark_warm('warn')).", message)
    return False


def record_joint_passes(entry: dict[str, Any]) -> None:
    """Note one run of the joint-graph fusion passes (``stats().joint``)."""
    with _lock:
        _joint.append(entry)
        del _joint[:-_JOINT_MAX]


def on_reset(fn: Callable[[], None]) -> None:
    """Call ``fn`` at the next :func:`reset` (once; a process-wide setting to undo)."""
    with _lock:
        if fn not in _on_reset:
            _on_reset.append(fn)


def record_count() -> int:
    """How many records exist now (``graphgear.cache`` marks the ones created after)."""
    with _lock:
        return len(_records)


def records_since(n: int) -> list[GraphRecord]:
    """The records created after :func:`record_count` returned ``n``."""
    with _lock:
        return list(_records[n:])


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_RESUME = re.compile(r"torch_dynamo_resume_in_(\w+)_at_(\d+)$")


def graph_source(gm: fx.GraphModule) -> str:
    """Where ``gm`` comes from, read from its nodes' ``stack_trace``: the function dynamo
    traced and the file and line of the graph's first op (``forward (modeling_qwen2.py:
    195)``). The code after a graph break (dynamo's resume function) is named after the
    function it resumes: ``forward after line 207 (modeling_qwen2.py:208)``."""
    for node in gm.graph.nodes:
        trace = node.meta.get("stack_trace") if node.op == "call_function" else None
        frames = _FRAME.findall(trace or "")
        if not frames:
            continue
        path, line, func = frames[0]
        resumed = _RESUME.match(func)
        name = f"{resumed.group(1)} after line {resumed.group(2)}" if resumed else func
        return f"{name} ({os.path.basename(path)}:{line})"
    return ""


def new_record(stage: str, mode: str) -> GraphRecord:
    """Create and register the record of a newly compiled graph."""
    with _lock:
        rec = GraphRecord(name=f"graph_{next(_counter):03d}_{stage}", stage=stage, mode=mode)
        _records.append(rec)
    return rec


def register_release(obj: Any) -> None:
    """Register an object with a ``release()`` method; ``reset()`` calls it.

    Held weakly: an artifact that is already gone needs no release.
    """
    with _lock:
        _releasers.append(weakref.ref(obj))


def stats() -> Stats:
    """Statistics of every graph compiled since the last :func:`reset`."""
    with _lock:
        w = _warm[0]
        return Stats(list(_records), list(_joint), dataclasses.replace(w, events=list(w.events)))


def reset() -> None:
    """Drop every compiled and captured graph and free its memory.

    Functions compiled before keep working: dynamo's caches are cleared too, so their
    next call compiles again.

    Call it while no other thread is calling a compiled function: it calls
    ``torch.compiler.reset()``, which can crash the process (a segmentation fault in
    dynamo's frame evaluation) when another thread runs any ``torch.compile``d function
    meanwhile, with every backend (measured on torch 2.13 with ``backend="eager"``).
    graphgear's own part is safe from any thread: a call in flight elsewhere completes
    with the right values (see ``capture.engine``).
    """
    global _counter
    with _lock:
        _counter = itertools.count()
        releasers = list(_releasers)
        _releasers.clear()
        _records.clear()
        _joint.clear()
        _warm[0] = WarmStats()
    for ref in releasers:
        obj = ref() if isinstance(ref, weakref.ref) else ref
        if obj is not None:
            obj.release()
    torch.compiler.reset()  # public; clears dynamo's caches
    with _lock:
        hooks = list(_on_reset)
        _on_reset.clear()
    for fn in hooks:
        fn()
    log.debug("graphgear.reset(): released %d artifacts", len(releasers))

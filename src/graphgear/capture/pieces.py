"""Piecewise capture's run: captured pieces, with the split nodes run between them.

:class:`PiecewiseGraph` is what a piecewise graph key runs: its :class:`~graphgear.capture.split.Segment`\\ s
in order, each captured piece through its own capture engine (a piece is captured,
replayed, keyed and released with the rules of a whole graph), each run of split nodes as
it is. A piece's outputs are read by the segments after it in the same call, before
that piece replays again: each piece has memory of its own (pieces of the graph's other
keys share it), so a later piece never writes where an earlier one's outputs lie.

:class:`PieceRecord` is a piece's line in ``stats()``: the counters an engine keeps,
added to its graph's record as they grow (``captures`` and ``replays`` of a piecewise
graph count pieces).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import fx

from .._torch.aot import boxed_convention
from .split import Segment, graph_output, segment_values

if TYPE_CHECKING:
    from ..stats import GraphRecord

__all__ = ["PieceRecord", "PiecewiseGraph"]

_COUNTERS = frozenset({"captures", "replays", "uncaptured_runs", "rebinds", "recaptures"})


@dataclasses.dataclass
class PieceRecord:
    """One captured piece of a graph: its counters, also counted in ``graph``'s record."""

    graph: Any = dataclasses.field(repr=False)
    name: str = ""
    ops: list[str] = dataclasses.field(default_factory=list)
    captures: int = 0
    replays: int = 0
    uncaptured_runs: int = 0
    rebinds: int = 0
    recaptures: int = 0
    pool_bytes: int = 0
    fallbacks: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _COUNTERS and "graph" in self.__dict__:
            parent = self.__dict__["graph"]
            setattr(parent, name, getattr(parent, name) + value - self.__dict__.get(name, 0))
        object.__setattr__(self, name, value)
        if name == "pool_bytes" and "graph" in self.__dict__:
            parent = self.__dict__["graph"]
            parent.pool_bytes = sum(p.pool_bytes for p in parent.pieces)

    @property
    def passes(self) -> dict[str, int]:
        """The graph's pass counts (the static compile of a piece counts its passes there)."""
        return self.graph.passes  # type: ignore[no-any-return]

    def add_fallback(self, op: str, reason: str) -> None:
        if (op, reason) not in self.fallbacks:
            self.fallbacks.append((op, reason))
        self.graph.add_fallback(op, f"{self.name}: {reason}")

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "graph"}


def piece_record(record: GraphRecord, index: int, ops: Sequence[str]) -> PieceRecord:
    """The record of piece ``index`` of ``record``'s graph (made once; the pieces of every
    key of the graph share it)."""
    for p in record.pieces:
        if p.name == f"{record.name}.piece{index}":
            return p  # type: ignore[no-any-return]
    p = PieceRecord(record, f"{record.name}.piece{index}", list(ops))
    record.pieces.append(p)
    return p


@boxed_convention
class PiecewiseGraph:
    """One graph key of a piecewise graph (see the module docstring); boxed."""

    def __init__(self, gm: fx.GraphModule, segments: Sequence[Segment],
                 runs: Sequence[Callable[[list[Any]], Any]], *, warmup_calls: int) -> None:
        self.warmup_calls = warmup_calls  # calls that warm up and capture every piece
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        slots = segment_values(segments, placeholders)
        self.width = len(slots)
        self.n_inputs = len(placeholders)
        self.steps = [(run, [slots[a] for a in seg.inputs], [slots[n] for n in seg.outputs])
                      for seg, run in zip(segments, runs)]
        out = graph_output(gm)
        self.single = not isinstance(out, list | tuple)
        items = [out] if self.single else list(out)
        # (slot, None) for a value of the graph, (None, constant) otherwise
        self.result = [(slots[o], None) if isinstance(o, fx.Node) else (None, o) for o in items]
        self.engines = [run for seg, run in zip(segments, runs) if seg.captured]

    def __call__(self, args: list[Any]) -> Any:
        env: list[Any] = list(args) + [None] * (self.width - self.n_inputs)
        for run, ins, outs in self.steps:
            got = run([env[i] for i in ins])
            for s, v in zip(outs, got):
                env[s] = v
        res = [env[s] if s is not None else c for s, c in self.result]
        return res[0] if self.single else res

    def precompile(self, args: list[Any]) -> None:
        """Warm up and capture every piece on ``args`` (``precompile_gears``)."""
        for _ in range(self.warmup_calls):
            self(list(args))

    def release(self) -> None:
        for e in self.engines:
            e.release()


def run_as_is(seg: Segment) -> Callable[[list[Any]], Any]:
    """A boxed callable running the split nodes of ``seg`` uncaptured."""
    gm = seg.gm

    def run(args: list[Any]) -> Any:
        return gm(*args)

    return run

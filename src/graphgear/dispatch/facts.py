"""What the pipeline knows of one dynamic AOT graph, handed to its dispatch in one piece."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ..shapes import ShapeInfo

if TYPE_CHECKING:
    from ..gears import GearPlan

__all__ = ["GraphFacts"]


@dataclasses.dataclass(frozen=True)
class GraphFacts:
    """One dynamic graph's facts for its dispatch by graph key (``graphgear.dispatch``)
    and its gear padding (``graphgear.padding``). Symbols are indices into
    ``info.symbols``; inputs indices into the graph's placeholders."""

    info: ShapeInfo
    #: the graph's gears (None: any key runs; a backward has none)
    plan: GearPlan | None
    #: the graph's stats record (:class:`~graphgear.stats.GraphRecord`)
    record: Any
    #: inputs the graph writes in place (KV caches)
    mutated: tuple[int, ...] = ()
    #: a training forward: its first ``caller_outputs`` outputs go to the caller (sliced
    #: when padded), the rest to its backward (kept at the gear's size); None: all
    caller_outputs: int | None = None
    #: a backward with gear padding: its tangents (the gradients of the caller's outputs)
    tangents: tuple[int, ...] = ()
    #: symbols no tensor depends on (``shapes.value_only_symbols``): every call runs the
    #: key of their first values
    value_only: tuple[int, ...] = ()
    #: the graph's SymInt outputs of the value-only symbols: ``(output index, SymInt)``,
    #: computed per call at the real values
    value_outputs: tuple[tuple[int, Any], ...] = ()
    #: symbols read from Python ints that reach tensor values (not shapes, not value-only):
    #: each value is a key of its own, up to :data:`~graphgear.dispatch.SCALAR_KEYS` per shape
    scalars: tuple[int, ...] = ()

"""What every mode compiler (and the capture engine) receives besides the graph."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import CompilerConfig
    from .stats import GraphRecord


@dataclasses.dataclass
class CompileContext:
    """One graph's compile: config, stage, stats record and input attributes.

    ``static_inputs`` are never copied (parameters, buffers, ``mark_static_address``);
    ``mutated_inputs`` are written in place by the graph (KV caches); ``input_names``
    are the user's names where dynamo knows them.
    """

    config: CompilerConfig
    stage: str
    record: GraphRecord
    input_names: list[str]
    static_inputs: list[int]
    mutated_inputs: list[int]
    #: state the capture engines of this graph share (their pool, the capture count);
    #: set by the reduce-overhead compiler on first use
    capture_group: Any = None
    #: the copies of frozen weights this graph's gears share, with the other graphs of
    #: its backend (:class:`~graphgear.cpu.frozen.FrozenCopies`; where none is
    #: given, the reduce-overhead compiler makes one on first use with ``frozen_parameter``)
    frozen_copies: Any = None
    #: the compile cache's :class:`~graphgear.artifacts.ArtifactStore` of this graph
    #: (``graphgear.cache``): compiled keys are recorded in it, stored keys loaded from it
    artifacts: Any = None
    #: a training forward: how many of its outputs return to the caller (the rest are
    #: saved for the backward); None: all of them, or not known
    caller_outputs: int | None = None

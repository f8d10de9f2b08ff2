"""What every mode compiler (and the capture engine) receives besides the graph."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import CompilerConfig
    from .stats import GraphRecord


@dataclasses.dataclass(frozen=True)
class CompileContext:
    """One graph's compile: config, stage, stats record and input attributes, made by the
    pipeline and read (never written) by the compilers.

    ``static_inputs`` are never copied (parameters, buffers, ``mark_static_address``);
    ``mutated_inputs`` are written in place by the graph (KV caches); ``input_names``
    are the user's names where dynamo knows them. A compile of one graph key gets
    :meth:`for_key`'s copy, which names the key and the compile cache's code of it.
    """

    config: CompilerConfig
    stage: str
    record: GraphRecord
    input_names: list[str]
    static_inputs: list[int]
    mutated_inputs: list[int]
    #: the copies of frozen weights the graphs of one backend share
    #: (:class:`~graphgear.cpu.frozen.FrozenCopies`; where none is given, the
    #: reduce-overhead compiler of a graph makes its own)
    frozen_copies: Any = None
    #: the compile cache's :class:`~graphgear.cache.artifacts.ArtifactStore` of this graph
    #: (``graphgear.cache``): compiled keys are recorded in it, stored keys loaded from it
    artifacts: Any = None
    #: a training forward: how many of its outputs return to the caller (the rest are
    #: saved for the backward); None: all of them, or not known
    caller_outputs: int | None = None
    #: the graph key of a static graph compiled per key (None: the graph as it is)
    key: tuple[int, ...] | None = None
    #: the compile cache's stored code of ``key`` (``artifacts.KeyArtifact``), used
    #: instead of compiling
    loaded: Any = None

    def for_key(self, key: tuple[int, ...] | None, loaded: Any = None) -> CompileContext:
        """This context for the compile of graph key ``key`` (``loaded``: its stored code)."""
        return dataclasses.replace(self, key=key, loaded=loaded)

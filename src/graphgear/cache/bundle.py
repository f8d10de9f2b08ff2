"""graphgear's compiled graph as AOTAutograd's bundled cache holds it (the compile cache).

torch 2.13's precompile keeps an AOTAutograd entry per compiled graph: AOTAutograd's
runtime metadata (input mutations, output aliases, the wrappers it puts around the
compiled code) plus the compiler's result, which must be an Inductor ``OutputCode``
(``AOTAutogradCache.make_entry``). :class:`GraphgearOutputCode` is graphgear's: it runs
graphgear's compiled callable (a geared dispatch, capture engines, Inductor's code) and
carries the graph's :class:`~graphgear.cache.artifacts.ArtifactStore` (the graph after the
passes, each key's compiled code). Loading the entry in a later process
(``_torch.serialize.load_bundled_entry``) rebuilds AOTAutograd's runtime wrappers without
tracing and calls :meth:`GraphgearOutputCode.post_compile`, which rebuilds graphgear's
callable from the store (:func:`graphgear.pipeline.rebuild_graph`): no AOTAutograd
trace, no passes, no specialisation, no Inductor compile for a stored key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from .._torch.aot import boxed_convention
from .._torch.serialize import OutputCode
from ..config import CompilerConfig
from ..pipeline import rebuild_graph
from .artifacts import ArtifactStore

__all__ = ["GraphgearOutputCode", "bundled_compiler"]


@dataclasses.dataclass
class GraphgearOutputCode(OutputCode):
    """One graph's compiled callable (``fn``, boxed) and what rebuilds it (``store``,
    ``config``: the config's ``as_dict()``)."""

    fn: Any = None
    store: ArtifactStore | None = None
    config: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # AOTAutograd's boxed convention (called with one list of inputs), set on the
        # instance: AOTAutograd's wrappers copy the instance's __dict__ (functools.wraps)
        boxed_convention(self)

    def __call__(self, inputs: Sequence[Any]) -> Any:
        return self.fn(inputs)

    def prepare_for_serialization(self) -> None:
        """Called on a copy that is pickled: the callable stays with the original."""
        self.fn = None

    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any) -> None:
        """After loading: rebuild the callable from the store (nothing to do after a
        compile, where ``fn`` is set)."""
        if self.fn is None:
            if self.store is None:
                raise ValueError("graphgear's bundled graph has neither a callable nor a store")
            self.fn = rebuild_graph(self.store, CompilerConfig.from_dict(self.config))

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        """Inductor's Triton bundle: graphgear's kernels travel inside the stored code."""

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["fn"] = None
        return state


def bundled_compiler(compiler: Callable[..., Any], config: CompilerConfig,
                     made: list[GraphgearOutputCode]) -> Callable[..., Any]:
    """``compiler`` (``pipeline.compile_graph`` with its keywords bound) returning a
    :class:`GraphgearOutputCode` with a fresh store per graph; each is appended to
    ``made``."""
    config_dict = config.as_dict()

    def compile_bundled(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> GraphgearOutputCode:
        store = ArtifactStore()
        fn = compiler(gm, example_inputs, artifacts=store, **kwargs)
        out = GraphgearOutputCode(fn=fn, store=store, config=config_dict)
        made.append(out)
        return out

    return compile_bundled

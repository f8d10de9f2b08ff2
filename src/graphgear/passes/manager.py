"""The pass manager: ordered, named FX passes, each timed, each switchable.

A pass is a :class:`GraphPass`: it has a ``name``, says whether the config enables it,
and rewrites a graph in place, returning how many changes it made. The manager runs the
enabled passes in order, records each pass's changes and time in the graph's stats
record, and dumps the graph after every pass that changed it (``debug.graph_dump``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import fx

from .. import debug
from .._torch.fx import stable_topological_sort
from ..regions import region_subgraphs

if TYPE_CHECKING:
    from ..config import CompilerConfig
    from ..stats import GraphRecord

log = logging.getLogger(__name__)

__all__ = ["GraphPass", "PassManager", "UserPass", "node_val", "sort_and_clean"]


class GraphPass:
    """Base class of one FX pass."""

    name = "pass"
    #: the pass needs static sizes to decide (a size limit): it runs again on each
    #: static graph a dynamic one is specialised to (one per gear or graph key)
    static_sizes = False
    #: the pass also runs inside each repeated region's shared subgraph
    #: (:mod:`graphgear.regions`): it rewrites ops where it finds them, reads nothing of
    #: the graph's own inputs, and never makes an output alias an input
    inside_regions = False

    def enabled(self, config: CompilerConfig) -> bool:
        return True

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: CompilerConfig) -> int:
        raise NotImplementedError


class UserPass(GraphPass):
    """A user function ``fn(gm, example_inputs, config)`` run as a pass."""

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.name = name
        self.fn = fn

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: CompilerConfig) -> int:
        before = len(gm.graph.nodes)
        text = str(gm.graph)
        result = self.fn(gm, example_inputs, config)
        if isinstance(result, fx.GraphModule) and result is not gm:
            raise TypeError(
                f"graphgear: user pass {self.name} returned a new GraphModule; passes must "
                "edit the graph they are given in place and return None."
            )
        return 1 if (len(gm.graph.nodes) != before or str(gm.graph) != text) else 0


class PassManager:
    """Runs passes in order; see the module docstring."""

    def __init__(self, passes: Sequence[GraphPass]) -> None:
        self.passes = list(passes)

    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def run(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        config: CompilerConfig,
        record: GraphRecord | None = None,
        *,
        counts: dict[str, int] | None = None,
        dump_name: str | None = None,
    ) -> fx.GraphModule:
        """Run the enabled passes in order. Each pass's changes are added to
        ``record.passes`` and ``counts`` (when given); after a pass that changed the
        graph, the graph is dumped under the record's name (or ``dump_name``)."""
        disabled = set(config.experimental_config.disabled_passes or ())
        for p in self.passes:
            if p.name in disabled or not p.enabled(config):
                continue
            t0 = time.perf_counter()
            changed = p(gm, example_inputs, config)
            if changed:
                gm.graph.lint()
                gm.recompile()
            dt = time.perf_counter() - t0
            log.debug("graphgear pass %s: %d changes in %.4fs", p.name, changed, dt)
            if counts is not None:
                counts[p.name] = counts.get(p.name, 0) + int(changed)
            if record is not None:
                record.passes[p.name] = record.passes.get(p.name, 0) + int(changed)
            name = record.name if record is not None else dump_name
            if changed and name is not None:
                debug.dump_graph(gm, config, name, f"after_{p.name}")
        inside = [p for p in self.passes if p.inside_regions and p.name not in disabled and p.enabled(config)]
        for sub in region_subgraphs(gm) if inside else ():
            # each call's copy of a shared subgraph gets the same rewrites: the same code
            PassManager(inside).run(sub, [node_val(n) for n in sub.graph.find_nodes(op="placeholder")],
                                    config, record, counts=counts)
        return gm


def node_val(n: Any) -> Any:
    """The fake value a node carries (``meta["val"]``), None for anything else."""
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def sort_and_clean(gm: fx.GraphModule) -> None:
    """After replacements: put every node after its inputs (a replacement goes where
    the match's output was; in a joint graph its inputs, the tangents, can come later)
    and drop what became dead."""
    stable_topological_sort(gm.graph)
    gm.graph.eliminate_dead_code()

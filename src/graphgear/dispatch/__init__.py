"""Run-time dispatch of one AOT graph by graph key, composed by the pipeline from what
a graph needs: :class:`KeyedGraph` (one compiled callable per key, built on first use;
the Python int rules), :class:`ValueOnly` (value-only ints share one key) and
:class:`GearGuard` (a key outside the gears raises before any work, or with
``gear_padding`` runs padded: ``graphgear.padding``). :func:`precompile_gears` builds
every gear up front. Each takes the graph's :class:`GraphFacts`."""

from .facts import GraphFacts
from .guard import GearGuard, PaddedRun
from .keyed import SCALAR_KEYS, Build, KeyedGraph, ValueOnly
from .precompile import precompile_gears, precompiling

__all__ = ["SCALAR_KEYS", "Build", "GearGuard", "GraphFacts", "KeyedGraph", "PaddedRun", "ValueOnly",
           "precompile_gears", "precompiling"]

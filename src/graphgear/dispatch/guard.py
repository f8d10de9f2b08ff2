"""The gears of one AOT graph enforced at run time (:class:`GearGuard`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._torch.aot import boxed_convention
from ..gears import GearPlan
from .keyed import KeyedGraph
from .precompile import precompiling

__all__ = ["GearGuard", "PaddedRun"]

#: runs a call whose key (second argument) lies between gears at the gear above (third)
PaddedRun = Callable[[list[Any], tuple[int, ...], tuple[int, ...]], Any]


@boxed_convention
class GearGuard:
    """A :class:`KeyedGraph` that runs only the keys of its :class:`GearPlan`. A key
    outside the gears raises :meth:`GearPlan.error` before any work, or with ``padded``
    (gear padding, ``graphgear.padding.PaddedCall``) is handed to ``padded`` with the
    next gear up; a key above every gear raises all the same. Inside
    :func:`~graphgear.dispatch.precompile_gears` the first call builds every gear."""

    def __init__(self, keyed: KeyedGraph, plan: GearPlan, padded: PaddedRun | None = None) -> None:
        self.keyed = keyed
        self.info = keyed.info
        self.plan = plan
        self.padded = padded
        self.per_key = keyed.per_key
        keyed.facts.record.gears = list(plan.combos)

    def __call__(self, args: list[Any]) -> Any:
        key = self.info.key(args)
        progress = precompiling()
        if progress is not None:
            self.keyed.build_keys(args, self.plan.all_keys(key), progress)
        if self.plan.allowed(key):
            return self.keyed.get(key)(args)
        target = self.plan.pad_target(key) if self.padded is not None else None
        if target is None:
            raise self.plan.error(key, self.padded is not None)
        return self.padded(args, key, target)

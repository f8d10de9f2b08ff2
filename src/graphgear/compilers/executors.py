"""The compiled code a capture engine runs, made before the engine exists.

:func:`native_code` is the Inductor compile of one static graph for a device graph (or
None, with one warning, where Inductor cannot compile it or the device captures the FX
graph itself). :class:`FrozenExecutor` is the executor of code that holds the static
inputs' values (``frozen_parameter``): one code per set of static inputs, made on its
first capture, and made again when their parameters were written in place.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from .._torch.dynamo import compile_session
from ..capture.devices import DeviceKind
from ..capture.executor import Executor, parameters_of

log = logging.getLogger(__name__)

__all__ = ["FrozenExecutor", "native_code"]


def native_code(compile_fn: Callable[..., Any], gm: fx.GraphModule, args: Sequence[Any], *,
                kind: DeviceKind, stage: str, static_idx: Sequence[int], name: str) -> Any:
    """``compile_fn(gm, args, stage=, static_idx=)`` (Inductor's code for a device graph of
    ``kind``), or None where the device captures the FX graph itself or Inductor cannot
    compile it (then with a warning: the FX graph is captured, same memory rules, no
    speed-up)."""
    if not kind.native():
        return None
    try:
        return compile_fn(gm, args, stage=stage, static_idx=static_idx)
    except Exception as e:
        log.warning(
            "graphgear: %s: Inductor could not compile this graph for the %s graph (%s: %s); "
            "capturing the FX graph itself (same memory rules, no speed-up).",
            name, kind.type, type(e).__name__, e,
        )
        return None


class FrozenExecutor(Executor):
    """Code that holds the values of the static inputs' parameters: ``make(args)`` gives
    the device graph's code for a capture on ``args``; it is made once per set of static
    inputs, and again once their parameters' version counters moved (written in place)."""

    holds_statics = True

    def __init__(self, make: Callable[[Sequence[Any]], Any]) -> None:
        super().__init__(None)
        self._make = make
        # ids of the static inputs -> (those inputs, held so that the ids stay theirs;
        # the code; the parameters' versions it was made from)
        self._made: dict[tuple[int, ...], tuple[tuple[Any, ...], Any, tuple[int, ...]]] = {}
        self._lock = threading.Lock()

    def code(self, args: Sequence[Any], statics: tuple[Any, ...] = ()) -> Any:
        which = tuple(map(id, statics))
        versions = self.versions(parameters_of(statics))
        made = self._made.get(which)
        if made is None or made[2] != versions:
            # dynamo's compile lock first, then this executor's (the order dispatch uses)
            with compile_session(), self._lock:
                made = self._made.get(which)
                if made is None or made[2] != versions:
                    made = self._made[which] = (statics, self._make(args), versions)
        return made[1]

    def forget(self, statics: tuple[Any, ...]) -> None:
        self._made.pop(tuple(map(id, statics)), None)

    def clear(self) -> None:
        self._made.clear()

    @property
    def made(self) -> list[Any]:
        return [m[1] for m in list(self._made.values())]

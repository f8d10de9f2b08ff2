"""Steps: which top-level compiled call a thread is in.

A *step* is one outermost call of a ``torch.compile``'d callable in one thread (a
model's forward, with every graph dynamo split it into). Outputs a replay hands out are
marked with their step (:class:`StepMark`, per arena). A replay that finds outputs of
its memory still alive tells two cases apart by it:

* the outputs were handed out in an earlier step: the caller kept them across calls of
  the compiled model; the replay overwrites them and they raise when read (the
  stale-output rule);
* they were handed out in this step (a block called twice in one forward: weight-tied
  layers, a shared expert, a module reused in a loop): eager gives both results, so the
  replay runs in another capture of the same code with memory of its own (a *lane*,
  ``pool.MemoryPool.lane``) and nothing is overwritten.

Outside any compiled call (the FX compiler called directly, a served model's direct
path) there is no step: every graph call is a top-level call of its own, as before.

Finding the step walks the thread's Python stack (about 1 µs); :class:`StepClock`
caches it while dynamo's count of top-level calls (all threads) stands still and the
step's token is alive, so a step walks it once per pool.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from .._torch.dynamo import compiled_call_generation, compiled_call_token

__all__ = ["StepClock", "StepMark"]


class StepClock:
    """The calling thread's current step (one per thread and pool: kept in the thread's
    arena, so it needs no lock)."""

    __slots__ = ("gen", "ref")

    def __init__(self) -> None:
        self.gen = -2
        self.ref: weakref.ref[Any] | None = None

    def current(self) -> Any | None:
        """The token of the step this thread is in, or None outside any."""
        g = compiled_call_generation()
        if g == self.gen and g >= 0:
            ref = self.ref
            if ref is None:  # no step, and no top-level compiled call began since
                return None
            tok = ref()
            if tok is not None:  # the same step (its token dies when it returns)
                return tok
        tok = compiled_call_token(sys._getframe(1))
        self.gen = g
        self.ref = weakref.ref(tok) if tok is not None else None
        return tok


class StepMark:
    """The step an arena's live hand-outs were made in."""

    __slots__ = ("ref",)

    def __init__(self) -> None:
        self.ref: weakref.ref[Any] | None = None

    def mark(self, token: Any | None) -> None:
        """Note that outputs were handed out in step ``token``."""
        ref = self.ref
        if token is None:
            self.ref = None
        elif ref is None or ref() is not token:
            self.ref = weakref.ref(token)

    def same(self, token: Any | None) -> bool:
        """Whether the hand-outs were made in step ``token`` (never outside a step)."""
        ref = self.ref
        return token is not None and ref is not None and ref() is token

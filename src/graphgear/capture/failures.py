"""What reduce-overhead does when a graph cannot be captured, and the messages it gives
(a capture that failed, a stale output, a graph run as it is)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch import fx

from ..errors import CaptureError
from .rules import warn

if TYPE_CHECKING:
    from .engine import CaptureEngine

log = logging.getLogger(__name__)

__all__ = ["UncapturedGraph", "capture_failed", "stale_message", "warn_safe_mode"]


class UncapturedGraph:
    """A graph ``fallback="eager"`` runs as it is (called with ``*args``), counting its runs."""

    def __init__(self, gm: fx.GraphModule, record: Any) -> None:
        self.gm = gm
        self.record = record

    def __call__(self, *args: Any) -> Any:
        self.record.uncaptured_runs += 1
        return self.gm(*args)


def stale_message(name: str, stage: str) -> str:
    """What reading an output a later replay overwrote raises."""
    return (
        f"graphgear: this tensor is an output of the reduce-overhead graph "
        f"{name} ({stage}), and a later replay of a graph in the same "
        f"memory pool has overwritten it. Clone outputs you keep before calling the "
        f"compiled model again (out.clone()), or set capture_config.clone_output=True."
    )


def warn_safe_mode(name: str) -> None:
    warn(f"graphgear: {name}: this process cannot mark overwritten outputs "
         f"(no output-liveness support, see the log); reduce-overhead returns copies of "
         f"its outputs instead (as capture_config.clone_output=True): correct, a little "
         f"slower.")


def capture_failed(engine: CaptureEngine, args: list[Any], ex: Exception, *, ran: bool) -> list[Any]:
    """After a failed capture (the inputs are as the caller passed them):
    ``fallback='raise'`` raises; else the graph runs once uncaptured: if that raises too,
    the error is the graph's own and reaches the caller (the next call tries to capture
    again); if not, its outputs are returned and the key runs uncaptured from now on.

    A graph with collectives whose failed capture ran (``ran``: the CPU graph's capture
    runs the graph) is not run again: its collectives may have been issued already, and
    issuing them twice would put this rank out of step with the others (a hang or wrong
    sums). Its error reaches the caller as it is; the next call tries to capture again."""
    record, stage, device = engine.record, engine.ctx.stage, engine.device
    reason = f"capture failed: {type(ex).__name__}: {ex}"
    if engine.cc.fallback == "raise":
        record.add_fallback("capture", reason)
        raise CaptureError(
            f"graphgear: could not capture {record.name} ({stage}) on "
            f"{device}: {reason}. The inputs are unchanged. "
            f"capture_config.fallback='raise' forbids running it uncaptured; set "
            f"fallback='eager' to run it uncaptured."
        ) from ex
    if ran and engine.collectives:
        log.warning("graphgear: capture of %s (%s) failed after running its collectives (%s): "
                    "%s; not run again uncaptured (that would issue them twice on this rank "
                    "only); the error reaches the caller.", record.name, stage,
                    ", ".join(engine.collectives), reason)
        raise ex
    record.uncaptured_runs += 1
    outs = list(engine.gm(*args))  # raises the graph's own error, once
    record.add_fallback("capture", reason)
    warn(f"graphgear: could not capture {record.name} ({stage}) on "
         f"{device}: {reason}. It runs uncaptured from now on; see "
         f"graphgear.stats() for the reason.")
    return outs

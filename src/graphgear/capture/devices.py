"""The device graphs reduce-overhead captures into, chosen by device type.

A device graph (:class:`DeviceGraph`) captures one static graph's compiled code once and
replays it; :data:`DEVICE_KINDS` says, per device type, which class that is and what the
mode compiler and the engine need to know about it (:class:`DeviceKind`). The engine
never branches on the device type: it asks the kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Protocol

import torch
from torch import fx

from .._torch.inductor import has_triton
from ..errors import CaptureError
from .cpu_graph import CPUExecutor, CPUGraph
from .cuda_graph import CUDAGraph
from .npu_graph import NPUGraph, npu_available

__all__ = ["DEVICE_KINDS", "DeviceGraph", "DeviceKind", "device_kind"]


class DeviceGraph(Protocol):
    """One captured static graph on one device."""

    #: capture runs the graph for real (inputs it mutates are written)
    runs_at_capture: bool
    #: a moved input bound in place is rebound (``rebind``), not captured again
    rebindable: bool
    released: bool
    nbytes: int
    #: the bound inputs (static buffers and inputs used in place)
    args: list[Any]

    def capture(self, args: list[Any]) -> list[Any] | None:
        """Capture on ``args``; the outputs of the run, or None (then ``replay`` gives them)."""

    def replay(self) -> list[Any] | None:
        """The outputs of one more run; None when released meanwhile."""

    def release(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class DeviceKind:
    """What reduce-overhead needs to know about one device type."""

    type: str
    #: ``graph(code, *, pool, name, device, mutated_idx, capture_error_mode)``: a new, empty
    #: device graph (``capture_error_mode``: ``capture_config``'s, for CUDA and NPU capture)
    graph: Callable[..., Any]
    #: ``code(compiled, gm, name)``: what the device graph runs, from Inductor's compiled
    #: code (None: it could not be compiled, or the device uses no native code: the FX graph)
    code: Callable[[Any, fx.GraphModule, str], Any]
    #: whether Inductor compiles the graphs this device captures (else the FX graph is captured)
    native: Callable[[], bool]
    #: the warm-up runs the compiled code through the device graph (a side stream), not
    #: the FX graph
    warms_on_device: bool
    #: input addresses are not baked into the capture (a moved input is rebound)
    rebindable: bool
    available: Callable[[], bool] = lambda: True


def _fx_code(compiled: Any, gm: fx.GraphModule, name: str) -> Callable[[list[Any]], Any]:
    """The compiled code as a boxed callable, or the FX graph where there is none."""
    if compiled is not None:
        return compiled  # type: ignore[no-any-return]
    return lambda a: gm(*a)


def _triton() -> bool:
    try:
        return has_triton()
    except Exception:
        return False


DEVICE_KINDS: Mapping[str, DeviceKind] = MappingProxyType({
    "cpu": DeviceKind("cpu", graph=lambda code, *, device, mutated_idx, capture_error_mode, **kw: CPUGraph(code, **kw),
                      code=CPUExecutor, native=lambda: True, warms_on_device=False, rebindable=True),
    # Inductor's GPU code needs Triton: without it the FX graph is captured
    "cuda": DeviceKind("cuda", graph=CUDAGraph, code=_fx_code, native=_triton, warms_on_device=True,
                       rebindable=False),
    # torch_npu brings its own kernels: the FX graph is captured as it is
    "npu": DeviceKind("npu", graph=NPUGraph, code=_fx_code, native=lambda: False, warms_on_device=True,
                      rebindable=False, available=npu_available),
})


def device_kind(device: torch.device, name: str) -> DeviceKind:
    """The kind of ``device``'s graphs; :class:`CaptureError` naming what is supported
    where there is none (``name``: the graph's)."""
    kind = DEVICE_KINDS.get(device.type)
    if kind is None or not kind.available():
        raise CaptureError(
            f"graphgear: reduce-overhead has no device graph for device {device} "
            f"(graph {name}); supported: cpu, cuda, npu (with torch_npu). "
            f"Use mode='max-autotune' for this device."
        )
    return kind

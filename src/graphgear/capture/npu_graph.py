"""Ascend NPU graphs ("aclgraph"): ``torch.npu.NPUGraph`` when ``torch_npu`` imports.

Same life cycle as the CUDA graph (side-stream warm-up, capture into the pool's private
memory, ``replay()``); the FX graph is captured as it is (torch_npu brings its own
kernels; Inductor is not used on the NPU).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .cuda_graph import CUDAGraph

log = logging.getLogger(__name__)

__all__ = ["NPUGraph", "npu_available"]


def npu_available() -> bool:
    """True when ``torch_npu`` imports and exposes NPU graphs."""
    try:
        import torch_npu  # noqa: F401
    except Exception:
        return False
    return hasattr(torch, "npu") and hasattr(torch.npu, "NPUGraph")


class NPUGraph(CUDAGraph):
    """One captured static graph on an Ascend NPU."""


    def _mod(self) -> Any:
        return torch.npu  # type: ignore[attr-defined]

    def _new_graph(self) -> Any:
        return torch.npu.NPUGraph()  # type: ignore[attr-defined]

    def _graph_ctx(self, graph: Any, pool: Any, stream: Any) -> Any:
        return torch.npu.graph(graph, pool=pool, stream=stream,  # type: ignore[attr-defined]
                               capture_error_mode=self.capture_error_mode)

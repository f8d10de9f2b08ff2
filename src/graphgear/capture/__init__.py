"""``mode="reduce-overhead"``'s capture layer: the device-neutral capture engine
(:class:`~graphgear.capture.engine.CaptureEngine`: keys, static inputs, warm-up, capture,
replay, liveness, limits, threads), its memory pools, the capture rules
(:mod:`~graphgear.capture.rules`), and one module per device graph: ``cpu_graph``
(graphgear's own), ``cuda_graph`` (``torch.cuda.CUDAGraph``), ``npu_graph``
(``torch.npu.NPUGraph``). The mode compiler that uses it is
``graphgear.compilers.reduce_overhead``.
"""

from __future__ import annotations

from .engine import CaptureEngine, UncapturedGraph
from .pool import MemoryPool
from .rules import find_uncapturable, graph_device

__all__ = ["CaptureEngine", "MemoryPool", "UncapturedGraph", "find_uncapturable", "graph_device"]

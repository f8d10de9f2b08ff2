"""CUDA graphs: ``torch.cuda.CUDAGraph`` capture and replay of one static graph.

The static graph is compiled once per graph key by the mode compiler (Inductor when
Triton is importable, else the FX graph as it is: ``devices.DEVICE_KINDS["cuda"]``); every capture of that key (one per
thread, one per address of an input bound in place) reuses the compiled code: a
re-capture never re-traces or recompiles. A capture warms the code up once on a side
stream (inputs the graph mutates are restored afterwards, so the warm-up leaves no
trace), then captures it on that stream into the calling thread's private memory pool
(``graph_pool_handle()``, shared as the engine's pool says) with
``capture_config.capture_error_mode`` (default ``"thread_local"``, so other threads may keep
using the GPU while one captures; ``"global"`` is torch's and TorchAir's default). Replay is ``graph.replay()`` on the calling thread's current stream; outputs
are the captured static tensors. Only runs on a machine with a GPU; everything around it
(keys, static inputs, copies, liveness, limits, fallback, threads) is device-neutral and
tested on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .pool import MemoryPool

log = logging.getLogger(__name__)

__all__ = ["CUDAGraph"]


class CUDAGraph:
    """One captured static graph on a CUDA device."""

    #: capture does not run the graph (the warm-up's mutations are undone)
    runs_at_capture = False
    #: input addresses are baked into the graph: a moved input means a new capture
    rebindable = False

    def __init__(self, executor: Callable[[list[Any]], Any], *, pool: MemoryPool, name: str,
                 device: torch.device, mutated_idx: Sequence[int] = (),
                 capture_error_mode: str = "thread_local") -> None:
        self.run = executor
        self.capture_error_mode = capture_error_mode
        self.mutated_idx = list(mutated_idx)
        self.pool = pool
        self.name = name
        self.device = device
        self.args: list[Any] = []
        self.outputs: list[Any] = []
        self.graph: Any = None
        self.nbytes = 0
        self.released = False

    def _mod(self) -> Any:
        return torch.cuda

    def warmup(self, args: list[Any]) -> list[Any]:
        """Run uncaptured on a side stream (first-use initialisation stays out of the graph)."""
        mod = self._mod()
        stream = mod.Stream(device=self.device)
        stream.wait_stream(mod.current_stream(self.device))
        with mod.stream(stream):
            outs = list(self.run(list(args)))
        mod.current_stream(self.device).wait_stream(stream)
        return outs

    def capture(self, args: list[Any]) -> None:
        """Capture the graph on ``args`` (static buffers and static inputs); the engine
        replays it to produce this call's outputs."""
        mod = self._mod()
        self.args = args
        saved = {i: args[i].clone() for i in self.mutated_idx if isinstance(args[i], torch.Tensor)}
        try:
            self.warmup(args)  # compiled code's first run (autotuning, lazy init)
        finally:
            for i, t in saved.items():
                args[i].copy_(t)
        mod.synchronize(self.device)
        before = mod.memory_allocated(self.device)
        self.graph = self._new_graph()
        stream = mod.Stream(device=self.device)
        with self._graph_ctx(self.graph, self.pool.device_handle(self.device), stream):
            self.outputs = list(self.run(list(args)))
        mod.synchronize(self.device)
        self.nbytes = max(0, mod.memory_allocated(self.device) - before)
        self.pool.add_bytes(self.nbytes)

    def _new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def _graph_ctx(self, graph: Any, pool: Any, stream: Any) -> Any:
        return torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=self.capture_error_mode)

    def replay(self) -> list[Any] | None:
        """Replay; None when :meth:`release` came first (another thread's reset)."""
        graph, outputs = self.graph, self.outputs
        if self.released or graph is None:
            return None
        graph.replay()
        return list(outputs)

    def release(self) -> None:
        self.released = True
        if self.graph is not None:
            self.graph.reset()
        self.graph = None
        self.outputs = []
        self.args = []

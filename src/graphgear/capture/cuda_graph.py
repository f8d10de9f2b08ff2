"""CUDA graphs: ``torch.cuda.CUDAGraph`` capture and replay of one static graph.

Capture compiles the static graph with Inductor when Triton is importable (else the FX
graph runs as it is), warms the compiled code up once on a side stream (inputs the
graph mutates are restored afterwards, so the warm-up leaves no trace), then captures
it on that stream into the pool's private memory (``graph_pool_handle()``, shared as
the engine's pool says). Replay is ``graph.replay()``; outputs are the captured static
tensors. Only runs on a machine with a GPU; everything around it (keys, static inputs,
copies, liveness, limits, fallback) is device-neutral and tested on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from .pool import MemoryPool

log = logging.getLogger(__name__)

__all__ = ["CUDAGraph"]


def _has_triton() -> bool:
    try:
        from torch.utils._triton import has_triton

        return bool(has_triton())
    except Exception:
        return False


class CUDAGraph:
    """One captured static graph on a CUDA device."""

    api = "cuda"

    def __init__(self, gm: fx.GraphModule, *, stage: str, static_idx: Sequence[int],
                 pool: MemoryPool, name: str, device: torch.device,
                 mutated_idx: Sequence[int] = ()) -> None:
        self.gm = gm
        self.stage = stage
        self.static_idx = list(static_idx)
        self.mutated_idx = list(mutated_idx)
        self.pool = pool
        self.name = name
        self.device = device
        self.args: list[Any] = []
        self.outputs: list[Any] = []
        self.graph: Any = None
        self.nbytes = 0
        self.native = False
        self._run: Callable[[list[Any]], Any] | None = None

    def _mod(self) -> Any:
        return torch.cuda

    def _executor(self, args: list[Any]) -> Callable[[list[Any]], Any]:
        if _has_triton():
            try:
                from .cpu_graph import compile_static

                compiled = compile_static(self.gm, args, stage=self.stage, static_idx=self.static_idx)
                self.native = True
                return compiled
            except Exception as e:
                log.warning("graphgear: %s: Inductor could not compile the graph to capture "
                            "(%s: %s); capturing the FX graph.", self.name, type(e).__name__, e)
        gm = self.gm
        return lambda a: gm(*a)

    def warmup(self, args: list[Any], fn: Callable[[list[Any]], Any] | None = None) -> list[Any]:
        """Run uncaptured on a side stream (first-use initialisation stays out of the graph)."""
        mod = self._mod()
        run = fn or (lambda a: self.gm(*a))
        stream = mod.Stream(device=self.device)
        stream.wait_stream(mod.current_stream(self.device))
        with mod.stream(stream):
            outs = list(run(list(args)))
        mod.current_stream(self.device).wait_stream(stream)
        return outs

    def capture(self, args: list[Any]) -> None:
        """Capture the graph on ``args`` (static buffers and static inputs); the engine
        replays it to produce this call's outputs."""
        mod = self._mod()
        self.args = args
        run = self._executor(args)
        self._run = run
        saved = {i: args[i].clone() for i in self.mutated_idx if isinstance(args[i], torch.Tensor)}
        self.warmup(args, run)  # compiled code's first run (autotuning, lazy init)
        for i, t in saved.items():
            args[i].copy_(t)
        mod.synchronize(self.device)
        before = mod.memory_allocated(self.device)
        self.graph = self._new_graph()
        stream = mod.Stream(device=self.device)
        with self._graph_ctx(self.graph, self.pool.device_handle(self.device), stream):
            self.outputs = list(run(list(args)))
        mod.synchronize(self.device)
        self.nbytes = max(0, mod.memory_allocated(self.device) - before)
        self.pool.add_bytes(self.nbytes)

    def _new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def _graph_ctx(self, graph: Any, pool: Any, stream: Any) -> Any:
        return torch.cuda.graph(graph, pool=pool, stream=stream)

    def replay(self) -> list[Any]:
        self.graph.replay()
        return list(self.outputs)

    def release(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph = None
        self.outputs = []
        self.args = []

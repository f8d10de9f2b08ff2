"""Memory pools of captured graphs.

A :class:`MemoryPool` is the memory that one or more captured graphs run in:

* on CUDA and NPU it carries the device graph pool handle (``graph_pool_handle()``)
  that captures share;
* on the CPU it holds graphgear's own arena: the ``k``-th buffer a capture allocates is
  the pool's block ``k`` (grown when a later capture needs more, moving the earlier
  captures' buffers along), so every capture that shares the pool runs in the same memory.

Sharing memory means a replay overwrites the outputs of every capture in the pool. The
pool therefore tracks the outputs it handed out and poisons them (see ``liveness``)
before any replay in it runs.

Who shares a pool: ``capture_config.use_custom_pool`` (one pool for several models);
else the captures of one FX graph (``reuse_pool_across_gears``, the default); else each
capture has a pool of its own.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

from . import liveness

log = logging.getLogger(__name__)

__all__ = ["MemoryPool"]

_ALIGN = 64


class MemoryPool:
    """Memory shared by captured graphs; pass one to ``capture_config.use_custom_pool``
    to make several compiled models share it.

    >>> pool = graphgear.capture.MemoryPool()
    >>> config.capture_config.use_custom_pool = pool
    """

    def __init__(self, pool_id: Any = None, *, name: str = "pool") -> None:
        # CUDA/NPU graph pool handle: given (a ``graph_pool_handle()`` tuple) or made on
        # first capture.
        self.pool_id = pool_id
        self.name = name
        self._blocks: list[torch.UntypedStorage] = []
        self._views: list[list[weakref.ref[torch.Tensor]]] = []
        self._bytes = 0
        self._handed: list[weakref.ref[torch.Tensor]] = []
        self._lock = threading.Lock()
        self.invalidations = 0

    # ---- device graph pools ------------------------------------------------------
    def device_handle(self, device: torch.device) -> Any:
        """The device graph pool handle, made on first use."""
        if self.pool_id is None:
            if device.type == "cuda":
                self.pool_id = torch.cuda.graph_pool_handle()
            elif device.type == "npu":
                self.pool_id = torch.npu.graph_pool_handle()  # type: ignore[attr-defined]
        return self.pool_id

    def add_bytes(self, nbytes: int) -> None:
        """Account memory a device graph took from this pool."""
        self._bytes += nbytes

    # ---- CPU arena ---------------------------------------------------------------
    def block(self, index: int, nbytes: int, device: torch.device) -> torch.UntypedStorage:
        """Block ``index`` of the arena, at least ``nbytes`` long.

        A block too small for a new capture is replaced by a larger one, and the buffers
        of earlier captures on it move to the new block (see :meth:`register`).
        """
        nbytes = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        with self._lock:
            while len(self._blocks) <= index:
                self._blocks.append(torch.UntypedStorage(0, device=device))
                self._views.append([])
            blk = self._blocks[index]
            if blk.nbytes() < nbytes or blk.device != device:
                # Grow: move every earlier capture's buffer on this block to the new
                # block (their contents are rewritten by each replay), so the captures
                # keep sharing one block. Outputs handed out over the old block were
                # poisoned before this capture started.
                new = torch.UntypedStorage(nbytes, device=device)
                live = []
                for ref in self._views[index]:
                    t = ref()
                    if t is not None:
                        t.set_(new, t.storage_offset(), t.size(), t.stride())
                        live.append(ref)
                self._views[index] = live
                self._bytes += nbytes - (blk.nbytes() if blk.device == device else 0)
                self._blocks[index] = blk = new
            return blk

    def register(self, index: int, t: torch.Tensor) -> None:
        """Note that ``t`` lives on block ``index``, so that growing the block moves it."""
        self._views[index].append(weakref.ref(t))

    @property
    def nbytes(self) -> int:
        """Bytes this pool has allocated (arena blocks, static buffers, device graphs)."""
        return self._bytes

    # ---- output liveness ---------------------------------------------------------
    def hand_out(self, t: torch.Tensor) -> None:
        """Track ``t`` (an alias of pool memory given to the user) for :meth:`invalidate`."""
        self._handed.append(weakref.ref(t))

    def invalidate(self, msg: str) -> int:
        """Poison every output handed out so far that is still alive; returns how many."""
        if not self._handed:
            return 0
        handed, self._handed = self._handed, []
        n = 0
        for ref in handed:
            t = ref()
            if t is not None:
                liveness.poison(t, msg)
                n += 1
        self.invalidations += n
        return n

    def release(self) -> None:
        """Poison handed-out outputs and drop the arena (captures hold their own refs)."""
        self.invalidate(
            "graphgear: this tensor was an output of a reduce-overhead graph that "
            "graphgear.reset() released; its memory is gone. Clone outputs you keep "
            "(out.clone()) or set capture_config.clone_output=True."
        )
        with self._lock:
            self._blocks.clear()
            self._views.clear()
            self._bytes = 0

    def __repr__(self) -> str:
        return f"MemoryPool({self.name!r}, {self._bytes} bytes, {len(self._blocks)} blocks)"

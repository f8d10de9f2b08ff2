"""Memory pools of captured graphs.

A :class:`MemoryPool` is the memory that one or more captured graphs run in. It keeps
one :class:`Arena` per thread: captures made in one thread run in that thread's arena,
so a replay in one thread never overwrites what another thread was handed (concurrent
callers get their own captures, as CUDA graph trees do).

An arena holds

* on CUDA and NPU, the device graph pool handle (``graph_pool_handle()``) that its
  captures share;
* on the CPU, graphgear's own blocks: the ``k``-th buffer a capture allocates is block
  ``k`` (grown when a later capture needs more, moving the earlier captures' buffers
  along), so every capture that shares the arena runs in the same memory;
* the outputs it handed out (``liveness.Handout``): before any replay in the arena runs,
  :meth:`MemoryPool.invalidate` poisons them, so reading one raises;
* the step those outputs were handed out in (``steps``): a graph called again in the
  same step while they are alive replays in a *lane* instead (:meth:`MemoryPool.lane`:
  a pool of its own, holding a second capture of the same code), so nothing of this
  step is overwritten.

**A thread that ends leaves its arena to the next new thread.** Servers run their
generation on a thread of their own, and some start a new one per session
(transformers' ``generate_batch`` does, per call): releasing the arena of each thread
that ended would capture every graph again in every session. A thread that calls into a
pool for the first time takes over the arena of the one thread of that pool that ended
(:meth:`MemoryPool.heir`), and the engines hand it that thread's captures. Outputs the
ended thread handed out are overwritten by the new thread's first replay and raise when
read, as when one thread calls again. Where several threads of the pool ended, none is
taken over: their arenas are released as before.

Who shares a pool: ``capture_config.use_custom_pool`` (one pool for several models);
else the captures of one FX graph (``reuse_pool_across_gears``, the default); else each
capture has a pool of its own.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from . import liveness
from .steps import StepClock, StepMark

log = logging.getLogger(__name__)

__all__ = ["Arena", "MemoryPool"]

_ALIGN = 64
_MAX_HEIRS = 1024

_RESET_MSG = (
    "graphgear: this tensor was an output of a reduce-overhead graph whose memory "
    "graphgear.reset() (or the end of its thread) released. Clone outputs you keep "
    "(out.clone()) or set capture_config.clone_output=True."
)


def _keep_at_end(kept: list[liveness.Handout], handed: list[liveness.Handout]) -> None:
    for h in handed:  # held aliases nothing else reaches die here
        h.held = None
    liveness.KEEPER.hold(kept + [h for h in handed if not h.ref.expired()])


class Arena:
    """One thread's memory in a :class:`MemoryPool`."""

    def __init__(self, device_handle: Any = None) -> None:
        self.device_handle = device_handle
        self.blocks: list[torch.UntypedStorage] = []
        self.views: list[list[weakref.ref[torch.Tensor]]] = []
        self.handed: list[liveness.Handout] = []
        # poisoned hand-outs still alive: their owners keep the memory a NumPy array
        # taken earlier may point at; pruned as they die, given to KEEPER at the end
        self.kept: list[liveness.Handout] = []
        # at its end, what it still holds goes to KEEPER: poisoned hand-outs, and ones a
        # call in flight handed out after the pool released it (graphgear.reset() from
        # another thread), which stay valid: no replay writes a released arena again
        weakref.finalize(self, _keep_at_end, self.kept, self.handed)
        self.nbytes = 0
        self.clock = StepClock()  # this thread's step (cached)
        self.step = StepMark()  # the step ``handed`` was handed out in

    def take_handed(self) -> list[liveness.Handout]:
        """The hand-outs so far, the list emptied in place (the finalizer holds it)."""
        handed = self.handed[:]
        self.handed.clear()
        return handed

    def prune_kept(self) -> None:
        if len(self.kept) > 16:
            self.kept[:] = [h for h in self.kept if not h.ref.expired()]


class MemoryPool:
    """Memory shared by captured graphs; pass one to ``capture_config.use_custom_pool``
    to make several compiled models share it (each thread gets its own arena in it).

    >>> pool = graphgear.capture.MemoryPool()
    >>> config.capture_config.use_custom_pool = pool
    """

    def __init__(self, pool_id: Any = None, *, name: str = "pool") -> None:
        # A given CUDA/NPU graph pool handle serves the first thread that captures;
        # other threads make their own.
        self.pool_id = pool_id
        self.name = name
        self._arenas: dict[int, Arena] = {}
        self._lock = threading.Lock()
        # lanes: pools of their own for graphs replayed again in one step while their
        # outputs of that step are alive (lane k: the k-th live instance)
        self._lanes: dict[int, MemoryPool] = {}
        # thread that ended -> the thread that took over its arena (resolved in chains)
        self._heirs: dict[int, int] = {}

    def lane(self, k: int) -> MemoryPool:
        """Lane ``k`` of this pool (0: the pool itself): memory of its own, shared by the
        ``k``-th captures of every graph in this pool, made on first use."""
        if k == 0:
            return self
        p = self._lanes.get(k)
        if p is None:
            with self._lock:
                p = self._lanes.setdefault(k, MemoryPool(name=f"{self.name} (lane {k})"))
        return p

    @property
    def has_lanes(self) -> bool:
        """Whether a lane of this pool was made."""
        return bool(self._lanes)

    def _lane_pools(self) -> list[MemoryPool]:
        return list(self._lanes.values())

    # ---- per-thread arenas -------------------------------------------------------
    def arena(self) -> Arena:
        """The calling thread's arena: made on first use, or taken over from the one
        thread of this pool that ended (see the module docstring)."""
        tid = threading.get_ident()
        a = self._arenas.get(tid)
        if a is None:
            with self._lock:
                a = self._arenas.get(tid) or self._take_over(tid)
                if a is None:
                    handle = self.pool_id if not self._arenas else None
                    a = self._arenas.setdefault(tid, Arena(handle))
        return a

    def _take_over(self, tid: int) -> Arena | None:
        """(Under the lock.) The arena of the one thread of this pool that ended, now
        ``tid``'s, with no step marked; None where no thread, or several, ended."""
        alive = {t.ident for t in threading.enumerate()}
        ended = [t for t in self._arenas if t not in alive]
        if len(ended) != 1:
            return None
        old = ended[0]
        a = self._arenas.pop(old)
        a.clock, a.step = StepClock(), StepMark()
        self._arenas[tid] = a
        for k, v in list(self._heirs.items()):
            if v == old:
                self._heirs[k] = tid
        self._heirs[old] = tid
        while len(self._heirs) > _MAX_HEIRS:  # the oldest: their captures were long released
            del self._heirs[next(iter(self._heirs))]
        log.debug("graphgear: %s: thread %d took over the arena of thread %d, which ended",
                  self.name, tid, old)
        return a

    def heir(self, tid: int) -> int | None:
        """The thread that took over the arena of thread ``tid`` (which ended), if any."""
        return self._heirs.get(tid)

    def prune(self, alive: Iterable[int]) -> None:
        """Release the arenas of threads not in ``alive`` (thread idents)."""
        keep = set(alive)
        with self._lock:
            dead = [t for t in self._arenas if t not in keep]
            arenas = [self._arenas.pop(t) for t in dead]
        for a in arenas:
            self._release_arena(a)
        for p in self._lane_pools():
            p.prune(keep)

    # ---- device graph pools ------------------------------------------------------
    def device_handle(self, device: torch.device) -> Any:
        """The calling thread's device graph pool handle, made on first use."""
        a = self.arena()
        if a.device_handle is None:
            if device.type == "cuda":
                a.device_handle = torch.cuda.graph_pool_handle()
            elif device.type == "npu":
                a.device_handle = torch.npu.graph_pool_handle()  # type: ignore[attr-defined]
            with self._lock:
                if self.pool_id is None:
                    self.pool_id = a.device_handle
        return a.device_handle

    def add_bytes(self, nbytes: int) -> None:
        """Account memory a device graph took from this pool (calling thread)."""
        self.arena().nbytes += nbytes

    # ---- CPU arena blocks --------------------------------------------------------
    def block(self, index: int, nbytes: int, device: torch.device, arena: Arena | None = None
              ) -> torch.UntypedStorage:
        """Block ``index`` of the calling thread's arena (``arena``: the one a capture
        started in, so that a :meth:`release` from another thread meanwhile leaves the
        capture whole in its own), at least ``nbytes`` long.

        A block too small for a new capture is replaced by a larger one, and the buffers
        of earlier captures on it move to the new block (see :meth:`register`). Outputs
        handed out over the old block were poisoned before this capture started; the old
        block itself lives on while any of them can still reach it (``liveness.KEEPER``).
        """
        a = arena or self.arena()
        nbytes = max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)
        while len(a.blocks) <= index:
            a.blocks.append(torch.UntypedStorage(0, device=device))
            a.views.append([])
        blk = a.blocks[index]
        if blk.nbytes() < nbytes or blk.device != device:
            new = torch.UntypedStorage(nbytes, device=device)
            live = []
            # under inference mode: buffers of a capture made under inference_mode are
            # inference tensors, which refuse set_ outside it (a pool shared with a model
            # captured under no_grad; a refusal halfway would leave a capture's buffers
            # split between the two blocks); other tensors take set_ there as well
            with torch.inference_mode():
                for ref in a.views[index]:
                    t = ref()
                    if t is not None:
                        t.set_(new, t.storage_offset(), t.size(), t.stride())
                        live.append(ref)
            a.views[index] = live
            a.nbytes += nbytes - (blk.nbytes() if blk.device == device else 0)
            a.blocks[index] = blk = new
        return blk

    def register(self, index: int, t: torch.Tensor, arena: Arena | None = None) -> None:
        """Note that ``t`` lives on block ``index`` (of ``arena``, as :meth:`block`), so
        that growing the block moves it."""
        refs = (arena or self.arena()).views[index]
        if len(refs) >= 64:  # rebuilt replays (a rebound input) leave dead ones behind
            refs[:] = [r for r in refs if r() is not None]
        refs.append(weakref.ref(t))

    @property
    def nbytes(self) -> int:
        """Bytes this pool has allocated (arena blocks, static buffers, device graphs)."""
        return (sum(a.nbytes for a in list(self._arenas.values()))
                + sum(p.nbytes for p in self._lane_pools()))

    # ---- output liveness ---------------------------------------------------------
    def hand_out(self, static: torch.Tensor, arena: Arena | None = None,
                 last: liveness.Handout | None = None) -> liveness.Handout:
        """Hand ``static`` (pool memory) out to the user through an alias, tracked for
        :meth:`invalidate`; ``arena``: the calling thread's, when the caller has it.
        ``last``: this output's previous hand-out; its alias is handed out again when the
        last invalidation found nothing else reaching it (``liveness`` module docstring).
        Returns the hand-out; the alias is its ``held``."""
        a = arena or self.arena()
        if last is not None and last.free and last.matches(static):
            last.free = False
            a.handed.append(last)
            return last
        h = liveness.Handout(liveness.alias(static), static.untyped_storage())
        a.handed.append(h)
        return h

    def recycle(self, arena: Arena | None = None) -> None:
        """Free, for their graphs to hand out again, the calling thread's hand-outs that
        nothing but graphgear reaches (``liveness`` module docstring); the others stay
        handed out (and :meth:`invalidate` poisons them)."""
        a = arena or self.arena()
        if a.handed:
            a.handed[:] = liveness.recycle_unused(a.handed)

    def handed_ptrs(self) -> set[int]:
        """Data pointers of the calling thread's outputs that are still valid (in
        every lane)."""
        ptrs = {h.ptr for h in self.arena().handed if h.alive()}
        for p in self._lane_pools():
            ptrs |= p.handed_ptrs()
        return ptrs

    def invalidate(self, msg: str, arena: Arena | None = None) -> int:
        """Poison every output the calling thread was handed that is still alive;
        ``arena``: the calling thread's, when the caller has it."""
        a = arena or self.arena()
        if not a.handed:
            return 0
        handed = liveness.recycle_unused(a.take_handed())
        if not handed:
            return 0
        poison = liveness.poisoner()
        if poison is None:
            return 0
        a.prune_kept()
        return liveness.poison_all(handed, msg, poison, a.kept)

    def _release_arena(self, a: Arena) -> None:
        handed = a.take_handed()
        poison = liveness.poisoner() if handed else None
        if poison is not None:
            liveness.poison_all(handed, _RESET_MSG, poison, a.kept)
        for h in handed:  # (poison_all let go of them already where it ran)
            h.held = None
        kept, a.kept[:] = list(a.kept), []
        liveness.KEEPER.hold(kept)
        # The arena is out of the pool now; its blocks are freed with it, when the last
        # user lets go: a capture another thread is making in it (graphgear.reset() from
        # one thread while another captures) completes whole, its buffers its own.

    def release(self) -> None:
        """Poison every handed-out output of every thread and drop the memory (what a
        live alias can still reach is kept until it is gone)."""
        with self._lock:
            arenas = list(self._arenas.values())
            self._arenas.clear()
        for a in arenas:
            self._release_arena(a)
        for p in self._lane_pools():
            p.release()

    def __repr__(self) -> str:
        blocks = sum(len(a.blocks) for a in list(self._arenas.values()))
        return f"MemoryPool({self.name!r}, {self.nbytes} bytes, {blocks} blocks, {len(self._arenas)} threads)"

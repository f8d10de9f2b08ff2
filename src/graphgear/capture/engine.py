"""The capture engine: the device-neutral rules of ``mode="reduce-overhead"`` (the
capture layer's docstring, :mod:`graphgear.capture`, states them).

One :class:`CaptureEngine` serves one static FX graph (the mode compiler makes one per
graph key: a static graph as it is, a dynamic graph specialised per key). It owns the
captures of that graph: their keys, static buffers, warm-up, capture, replay, output
hand-out and release. It compiles nothing: the mode compiler hands it the compiled code
(:class:`~graphgear.capture.executor.Executor`) and the kind of device graph to capture
it in (:class:`~graphgear.capture.devices.DeviceKind`), and the engine never branches on
the device type.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from .._torch.aot import boxed_convention
from .._torch.storage import StorageWeakRef
from ..stats import register_release
from . import liveness
from .cpu_graph import nbytes_of
from .devices import DeviceKind
from .entry import DATA_PTR, Entry, InputRoles, getter, same_memory, static_buffer
from .executor import Executor, parameters_of
from .failures import capture_failed, stale_message, warn_safe_mode
from .group import CaptureGroup
from .pool import MemoryPool
from .rules import find_collectives

if TYPE_CHECKING:
    from ..context import CompileContext

log = logging.getLogger(__name__)

#: creation order of engines (tests and tools sort by it)
_serial = itertools.count()
#: marks the key of a lane's entry (``_free_lane``)
_LANE = "lane"

__all__ = ["CaptureEngine"]


@boxed_convention
class CaptureEngine:
    """Captures and replays one static FX graph (see the module docstring); boxed: called
    with one list of inputs."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext, *,
                 executor: Executor, kind: DeviceKind, device: torch.device, group: CaptureGroup,
                 native_warmup: bool = False, pool: MemoryPool | None = None) -> None:
        self.gm = gm
        self.executor = executor
        self.kind = kind
        # the compile cache's loaded code on the CPU (``gm`` may be the dynamic graph): a
        # warm-up inside precompile, whose outputs are dropped and whose input writes are
        # undone, is skipped (the code's first run is then the capture, as in the process
        # that compiled it); a warm-up a caller sees runs the FX graph, as there
        self.native_warmup = native_warmup and not kind.warms_on_device
        self.ctx = ctx
        self.record = ctx.record
        self.device = device
        cc = self.cc = ctx.config.capture_config
        self.group = group
        # a piece of a piecewise graph: memory of its own (shared with that piece of the
        # graph's other keys), so that it never writes where another piece's outputs lie
        self.pool = pool if pool is not None else group.pool_for(cc, ctx.record.name)
        roles = InputRoles.of(example_inputs, stage=ctx.stage, static_inputs=ctx.static_inputs,
                              mutated_inputs=ctx.mutated_inputs, clone_input=cc.clone_input)
        self.static_idx, self.mutated_idx, self.copy_idx = roles.static, roles.mutated, roles.copied
        # inputs used in place (their address is part of the capture)
        self.tracked_idx = self.mutated_idx + ([] if cc.clone_input else roles.others)
        # frozen_parameter: static inputs keyed by which tensors they are (their addresses
        # are promised fixed), else by address
        self.key_by_identity = ctx.config.experimental_config.frozen_parameter
        self._statics = getter(self.static_idx)
        self.scalar_idx = roles.scalars
        self.rebindable = kind.rebindable
        self.collectives = find_collectives(gm)
        self.clone_output = cc.clone_output or ctx.stage in ("forward", "backward")
        self.entries: dict[tuple[Any, ...], Entry] = {}
        self._staging: dict[tuple[int, int], torch.Tensor] = {}
        self._lock = threading.RLock()
        self._safe_warned = False
        self._stale = stale_message(self.record.name, ctx.stage)  # passed on every replay
        self.calls = 0
        self.serial = next(_serial)
        register_release(self)

    # ---- keys and entries ------------------------------------------------------------
    def _static_key(self, args: Sequence[Any]) -> tuple[int, ...]:
        return tuple(map(id if self.key_by_identity else DATA_PTR, self._statics(args)))

    def _key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        key = (threading.get_ident(), self._static_key(args),
               tuple(args[i] for i in self.scalar_idx) if self.scalar_idx else ())
        if not self.rebindable:
            key += (tuple(args[i].data_ptr() if isinstance(args[i], torch.Tensor) else None
                          for i in self.tracked_idx),)
        return key

    def _new_entry(self, key: tuple[Any, ...], args: Sequence[Any], pool: MemoryPool | None = None,
                   lane: int = 0) -> Entry:
        with self._lock:
            self._release_dead()
            e = Entry(pool=pool if pool is not None else self.pool, lane=lane)
            if lane:
                e.warm = self.cc.warmup_iters  # a second instance of warmed-up code
            elif not self.rebindable and any(k[:3] == key[:3] for k in self.entries):
                e.warm = self.cc.warmup_iters  # same code, inputs moved: no new warm-up
                e.recapture = True
            self.entries[key] = e
        if self.key_by_identity:
            e.statics = self._statics(args)
            if self.executor.holds_statics:
                e.params = parameters_of(e.statics)
        return e

    def _release_dead(self) -> None:
        """Release the captures of threads that ended, and this thread's captures whose
        inputs bound in place died (another thread's are its own to release)."""
        alive = {t.ident for t in threading.enumerate()}
        me = threading.get_ident()
        self._release_where(lambda k, e: (k[0] not in alive and e.pool.heir(k[0]) not in alive)
                            or (k[0] == me and any(r.expired() for r in e.bound_refs)))
        for k in [k for k in self._staging if k[0] not in alive and self.pool.heir(k[0]) not in alive]:
            del self._staging[k]
        self.pool.prune(alive)

    def _inherit(self) -> bool:
        """Take over the captures of threads that ended whose arenas this thread took
        over (``pool.MemoryPool.heir``: a server's next session thread); whether any."""
        me = threading.get_ident()
        moved = False
        with self._lock:
            for k, e in list(self.entries.items()):
                if k[0] != me and e.pool.heir(k[0]) == me and (me, *k[1:]) not in self.entries:
                    self.entries[(me, *k[1:])] = self.entries.pop(k)
                    moved = True
            for k in [k for k in self._staging if k[0] != me and self.pool.heir(k[0]) == me]:
                self._staging[(me, k[1])] = self._staging.pop(k)
        return moved

    def _release_where(self, doomed: Any) -> None:
        """Release (and forget) every entry ``doomed(key, entry)`` names."""
        with self._lock:
            for k, e in list(self.entries.items()):
                if doomed(k, e):
                    if e.graph is not None:
                        self.group.release(e.graph)
                    del self.entries[k]

    # ---- the call --------------------------------------------------------------------
    def __call__(self, args: list[Any]) -> list[Any]:
        return self._call(args, False)

    def precompile(self, args: list[Any]) -> None:
        """Warm up and capture the key of ``args`` now, as that many calls would
        (``precompile_gears``); the outputs are dropped, so a warm-up of loaded code is
        skipped (see ``native_warmup``)."""
        for _ in range(self.cc.warmup_iters + 1):
            self._call(list(args), True)

    def _call(self, args: list[Any], discard: bool) -> list[Any]:
        self.calls += 1
        arena = self.pool.arena()
        if arena.handed:
            self.pool.recycle(arena)  # outputs the caller dropped: handed out again
        if self.tracked_idx and (arena.handed or self.pool.has_lanes):
            self._stage_fed_back(args)
        key = self._key(args)
        lane = 0
        if arena.handed:  # outputs still alive: of this step, this call needs a lane
            free = self._free_lane(arena)
            if free is None:
                return self._run_uncaptured(args)
            lane, pool, arena = free
            if lane:
                key += (_LANE, lane)
        e = self.entries.get(key)
        if e is None and self._inherit():
            e = self.entries.get(key)
        if e is None:
            e = self._new_entry(key, args, self.pool.lane(lane), lane)
        g = e.graph
        if e.params and g is not None and self.executor.versions(e.params) != e.versions:
            e, g = self._weights_written(key, args, e), None
        if g is not None and self.cc.force_recapture and not g.released:
            # capture_config.force_recapture: drop the capture and capture this call again
            self.group.release(g)
            e.graph, g, e.recapture = None, None, True
            return self._capture(e, args)
        if g is None:
            if e.uncaptured:
                return self._run_uncaptured(args)
            if e.warm < self.cc.warmup_iters:
                e.warm += 1
                self.record.uncaptured_runs += 1
                return self._warmup(args, discard)
            return self._capture(e, args)
        bound = g.args
        if g.released:  # graphgear.reset() in another thread since the lookup
            return self._run_uncaptured(args)
        if e.bound_refs and any(r.expired() for r in e.bound_refs):
            # a new tensor at the address a dead one was captured with: it is this
            # capture's now (the graph writes that address), not a dead capture
            e.bound_refs = self._refs(args)
        if self.rebindable:
            moved = False
            for i in self.tracked_idx:
                a = args[i]
                if a is not bound[i] and not same_memory(a, bound[i]):
                    g.rebind(i, a)  # a new KV cache: same code, same record
                    moved = True
            if moved:
                self.record.rebinds += 1
        for i in e.copy_idx:
            bound[i].copy_(args[i])
        e.pool.invalidate(self._stale, arena)
        outs = g.replay()
        if outs is None:  # released by another thread before it ran
            return self._run_uncaptured(args)
        self.record.replays += 1
        return self._hand_out(e, outs, arena)

    def _free_lane(self, arena: Any) -> tuple[int, MemoryPool, Any] | None:
        """Where a call runs whose pool still has outputs alive after recycling
        (``arena``: the calling thread's arena of the engine's pool): there (lane 0), when
        they were handed out in an earlier step (this replay overwrites them: the
        stale-output rule), else in the first lane whose outputs are not of this step
        (``steps``); None when every lane up to ``capture_limit`` holds outputs of this
        step (the call then runs uncaptured: fresh outputs)."""
        token = arena.clock.current()
        if not arena.step.same(token):
            return 0, self.pool, arena
        for lane in range(1, self.cc.capture_limit + 1):
            pool = self.pool.lane(lane)
            a = pool.arena()
            if a.handed:
                pool.recycle(a)
            if not a.handed or not a.step.same(token):
                return lane, pool, a
        return None

    def _refs(self, args: Sequence[Any]) -> list[StorageWeakRef]:
        return [StorageWeakRef(args[i].untyped_storage()) for i in self.tracked_idx
                if isinstance(args[i], torch.Tensor)]

    def _weights_written(self, key: tuple[Any, ...], args: list[Any], old: Entry) -> Entry:
        """The parameters frozen code holds were written in place since it was made
        (their version counters moved): drop that code and every capture of it (each
        thread's), and start ``key`` again; it warms up on the new values and captures
        new code."""
        statics = self._statics(args)
        which = tuple(map(id, statics))
        log.info("graphgear: %s: frozen weights were written in place since its code was made; "
                 "compiling it again from the new values", self.record.name)
        self.executor.forget(statics)
        self._release_where(lambda k, e: bool(e.statics) and tuple(map(id, e.statics)) == which)
        return self._new_entry(key, args, old.pool, old.lane)

    def _run_uncaptured(self, args: list[Any]) -> list[Any]:
        """Run the FX graph as it is (a key that runs uncaptured, past capture_limit, or
        whose capture another thread's ``graphgear.reset()`` released before its replay)."""
        self.record.uncaptured_runs += 1
        return list(self.gm(*args))

    def _stage_fed_back(self, args: list[Any]) -> None:
        """An input used in place that is a live output of this pool (an output fed back
        in, ``clone_input=False``) would be overwritten while the graph reads it: copy it
        to a buffer of its own first (one per thread and input, with a stable address)."""
        live = self.pool.handed_ptrs()
        if not live:
            return
        for i in self.tracked_idx:
            a = args[i]
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in live:
                k = (threading.get_ident(), i)
                buf = self._staging.get(k)
                if (buf is None or buf.size() != a.size() or buf.stride() != a.stride()
                        or buf.dtype != a.dtype):
                    buf = self._staging[k] = torch.empty_strided(a.size(), a.stride(), dtype=a.dtype,
                                                                 device=a.device)
                args[i] = buf.copy_(a)

    def _device_graph(self, args: list[Any], statics: tuple[Any, ...], pool: MemoryPool | None = None) -> Any:
        return self.kind.graph(self.executor.code(args, statics), pool=pool or self.pool, name=self.record.name,
                               device=self.device, mutated_idx=self.mutated_idx,
                               capture_error_mode=self.cc.capture_error_mode)

    def _warmup(self, args: list[Any], discard: bool) -> list[Any]:
        if self.kind.warms_on_device:
            return self._device_graph(args, self._statics(args)).warmup(list(args))  # type: ignore[no-any-return]
        if discard and self.native_warmup:
            return []
        return list(self.gm(*args))

    def _capture(self, e: Entry, args: list[Any]) -> list[Any]:
        if not self.group.take_slot(self.cc, self.record, self.ctx.stage):
            e.uncaptured = True
            return self._run_uncaptured(args)
        bound = list(args)
        nbytes = 0
        e.copy_idx = [i for i in self.copy_idx if isinstance(args[i], torch.Tensor)]
        for i in e.copy_idx:
            a = args[i]
            bound[i] = static_buffer(a).copy_(a)
            nbytes += nbytes_of(a.size(), a.stride(), a.dtype)
        e.pool.invalidate(self._stale)
        if not self.clone_output and liveness.poisoner() is None:
            self._enter_safe_mode()
        e.versions = self.executor.versions(e.params)
        graph = self._device_graph(bound, self._statics(args), e.pool)
        snapshot = ({i: args[i].clone() for i in self.mutated_idx if isinstance(args[i], torch.Tensor)}
                    if graph.runs_at_capture else {})
        try:
            outs = graph.capture(bound)
            if outs is None:
                outs = graph.replay()
        except BaseException as ex:
            self.group.release(graph)
            for i, saved in snapshot.items():  # undo what the failed run wrote
                args[i].copy_(saved)
            if not isinstance(ex, Exception):
                # KeyboardInterrupt, SystemExit: the inputs are as passed, the slot is
                # free, the next call captures again
                raise
            outs = capture_failed(self, args, ex, ran=graph.runs_at_capture)
            e.uncaptured = True
            return outs
        e.pool.add_bytes(nbytes)
        e.graph = graph
        if not self.rebindable:
            e.bound_refs = self._refs(args)
            for i in self.tracked_idx:  # addresses are baked in: hold no reference
                graph.args[i] = None
        user = {args[i].untyped_storage().data_ptr() for i in self.static_idx + self.tracked_idx
                if isinstance(args[i], torch.Tensor)}
        e.alias_idx = [i for i, o in enumerate(outs)
                       if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in user]
        e.handouts = [None] * len(outs)
        self.record.captures += 1
        if e.recapture:
            self.record.recaptures += 1
        if e.lane:
            log.info("graphgear: %s (%s) was called again in one step while its outputs of that step "
                     "are in use: captured a second instance of its code (lane %d), with memory of its own",
                     self.record.name, self.ctx.stage, e.lane)
        self.record.pool_bytes = max(self.record.pool_bytes, self.pool.nbytes)
        log.info("graphgear: captured %s (%s) on %s: %d bytes", self.record.name,
                 self.ctx.stage, self.device, graph.nbytes + nbytes)
        return self._hand_out(e, outs)

    def _enter_safe_mode(self) -> None:
        self.clone_output = True
        if not self._safe_warned:
            self._safe_warned = True
            warn_safe_mode(self.record.name)

    def _hand_out(self, e: Entry, outs: list[Any], arena: Any = None) -> list[Any]:
        if self.clone_output:
            return [o.clone() if isinstance(o, torch.Tensor) else o for o in outs]
        res = list(outs)
        pool = e.pool
        last = e.handouts
        if e.alias_idx:  # the step these outputs belong to (``steps``)
            a = arena or pool.arena()
            a.step.mark(self.pool.arena().clock.current() if e.lane else a.clock.current())
        for i in e.alias_idx:
            h = pool.hand_out(res[i], arena, last[i])
            last[i] = h
            res[i] = h.held
        return res

    # ---- release ---------------------------------------------------------------------
    def release(self) -> None:
        """Drop every capture (every thread's) and free its memory; the next call warms
        up and captures again."""
        with self._lock:
            self._release_where(lambda k, e: True)
            self._staging.clear()
            self.executor.clear()
        self.pool.release()
        self.group.reset_count()

"""The capture engine: device-neutral rules of ``mode="reduce-overhead"``.

One :class:`CaptureEngine` serves one static FX graph (the backend hands over one per
graph key: a static graph as it is, a dynamic graph specialised per key). It owns the
captured graphs of that graph and applies the rules of DESIGN.md:

* **key**: the graph key (fixed per engine) plus the addresses of the static inputs: a
  parameter that moved gets a capture of its own. With ``frozen_parameter`` addresses
  are promised fixed and left out; the key holds which tensors the static inputs are
  instead (two instances of one model class share dynamo's graph: each gets captures,
  and where the code holds the weights' values, compiled code of its own).
* **static inputs** (parameters, buffers, ``mark_static_address``) are bound at capture
  and never copied. **Mutated inputs** (KV caches) are used in place, never copied. When
  one moves (a new cache), the CPU graph rebinds it (no new record, no compile); a CUDA
  or NPU graph, whose addresses are baked in, gets a capture of its own for that address
  (the compiled code is reused: no re-trace, no recompile), and a capture whose bound
  inputs have died is released with its memory. **Other inputs** are copied into the
  capture's static buffers before each replay (``clone_input``; with
  ``clone_input=False`` they are bound in place like mutated inputs). An input that is a
  live output of this pool (an output fed back in) is copied first.
* **threads**: each thread has its own captures and its own memory (an arena of the
  pool), so a replay in one thread never overwrites another thread's outputs.
* **warm-up**: ``warmup_iters`` uncaptured runs per capture before it is captured.
* **capture_limit**: at most that many live captures per FX graph (all keys and threads
  together), checked when a capture is about to be made; past it, new keys run
  uncaptured, with one warning and a ``stats()`` fallback entry.
* **outputs** live in the pool and are overwritten by the next replay in that pool;
  each is handed out through an alias whose storage the next replay in that memory
  poisons, so reading a stale output, or any view of it, raises ``RuntimeError`` naming
  the fix (``liveness``). ``clone_output`` returns fresh tensors (always done for
  training graphs, whose outputs are saved for backward or become gradients, and
  outlive the next replay, and where this process cannot poison storages).
* **what cannot be captured** (``rules.UNCAPTURABLE``: ``.item()``, data-dependent
  shapes, random numbers outside CUDA; CPU work inside a device graph; a capture that
  fails) follows ``fallback``: ``"eager"`` runs the graph uncaptured with one warning,
  ``"raise"`` raises :class:`graphgear.CaptureError`; ``stats()`` names op and reason.
  A capture that fails while running the graph first restores the inputs it mutated,
  so mutations happen exactly once; an error the graph raises by itself (it raises
  again when run uncaptured) reaches the caller unchanged.

The device graph itself (CPU, CUDA, NPU) is a small class with ``capture(args)``,
``replay()``, ``release()``, ``nbytes``, ``args`` (the bound inputs), and the flags
``runs_at_capture``, ``rebindable`` and ``released``; the compiled code it runs (its
executor) is made once per engine, or, where it holds the static inputs' values
(``frozen`` code: the parameters' values), once per set of static inputs. Frozen code
is also made again when those parameters were written in place since
(``load_state_dict``, an in-place update: their version counters moved): its captures
are dropped and the key warms up and captures again, so every gear sees the new
weights, as the uncaptured graph would. Static buffers stay inputs of frozen code, so
writing one between calls (a position counter) recompiles nothing.

**reset from another thread** (``graphgear.reset()`` while a thread is inside a call):
the call completes correctly. A replay whose graph was released before it ran runs the
graph uncaptured (``replay()`` returns None); one already running completes on what it
read; a capture completes in its thread's old arena; an output handed out into a
released arena keeps its memory until it dies (the arena hands it to
``liveness.KEEPER``), and nothing writes that memory again.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from .._torch.aot import boxed_convention
from .._torch.dynamo import compile_session
from .._torch.storage import StorageWeakRef, has_internal_overlap, tensor_version
from ..dispatch import precompiling
from ..errors import CaptureError
from ..stats import register_release
from . import liveness
from .cpu_graph import CPUExecutor, CPUGraph, StaticCompiler, nbytes_of
from .cuda_graph import CUDAGraph, cuda_executor
from .npu_graph import NPUGraph, npu_available, npu_executor
from .pool import MemoryPool
from .rules import find_collectives, warn

if TYPE_CHECKING:
    from ..context import CompileContext

log = logging.getLogger(__name__)

__all__ = ["CaptureEngine", "CaptureGroup", "UncapturedGraph"]


@dataclasses.dataclass
class CaptureGroup:
    """State shared by the engines of one FX graph (all its keys)."""

    pool: MemoryPool
    custom_pool: MemoryPool | None = None
    captures: int = 0
    limit_warned: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


_serial = itertools.count()


def _group(ctx: CompileContext) -> CaptureGroup:
    if ctx.capture_group is None:
        ctx.capture_group = CaptureGroup(pool=MemoryPool(name=ctx.record.name))
    group: CaptureGroup = ctx.capture_group
    return group


def _pool_for(ctx: CompileContext, group: CaptureGroup) -> MemoryPool:
    cc = ctx.config.capture_config
    custom = cc.use_custom_pool
    if custom is not None:
        if isinstance(custom, MemoryPool):
            return custom
        # a raw device pool handle: the backend turns it into its MemoryPool; one that
        # reaches here (a compiler built without a backend) serves this FX graph
        if group.custom_pool is None:
            group.custom_pool = MemoryPool(pool_id=custom, name=f"custom {custom}")
        return group.custom_pool
    if cc.reuse_pool_across_gears:
        return group.pool
    return MemoryPool(name=f"{ctx.record.name} (private)")


class UncapturedGraph:
    """A graph ``fallback="eager"`` runs as it is (called with ``*args``), counting its runs."""

    def __init__(self, gm: fx.GraphModule, record: Any) -> None:
        self.gm = gm
        self.record = record

    def __call__(self, *args: Any) -> Any:
        self.record.uncaptured_runs += 1
        return self.gm(*args)



@dataclasses.dataclass
class _Entry:
    """One capture: a graph key in one thread (and, where addresses are baked in, one
    set of addresses of the inputs bound in place)."""

    warm: int = 0
    graph: Any = None
    uncaptured: bool = False
    copy_idx: list[int] = dataclasses.field(default_factory=list)
    # the outputs in the graph's memory (handed out through aliases), and each one's
    # last hand-out (pool.hand_out gives its alias out again when unused)
    alias_idx: list[int] = dataclasses.field(default_factory=list)
    handouts: list[Any] = dataclasses.field(default_factory=list)
    bound_refs: list[StorageWeakRef] = dataclasses.field(default_factory=list)
    recapture: bool = False  # a key seen before with inputs used in place elsewhere
    # frozen_parameter: the static inputs the key names by identity, held so that their
    # ids stay theirs while the capture lives
    statics: tuple[Any, ...] = ()
    # frozen code: the parameters among ``statics`` (what it holds the values of: other
    # static inputs stay inputs) and their version counters when its code was made
    params: tuple[Any, ...] = ()
    versions: tuple[int, ...] = ()


_DATA_PTR = torch.Tensor.data_ptr  # (a method descriptor: map calls it without a Python frame)
_VERSION = tensor_version  # (map calls it without a Python frame)


def _parameters(statics: tuple[Any, ...]) -> tuple[Any, ...]:
    """The ``nn.Parameter``s among static inputs: what frozen code holds the values of
    (buffers and static-address state stay inputs, and may be written between calls)."""
    return tuple(t for t in statics if isinstance(t, torch.nn.Parameter))


def _same_memory(a: torch.Tensor, bound: torch.Tensor) -> bool:
    """Whether ``a`` starts where the bound input ``bound`` does. A bound input that was
    an output of a graph of this pool (a KV cache a graph made, then fed in to be updated
    in place) is poisoned when that graph replays: it is not the caller's any more, and
    the call's tensor is bound instead, wherever it lies."""
    where = a.data_ptr()  # (a stale output passed in raises here, as it should)
    try:
        return where == bound.data_ptr()
    except RuntimeError:
        return False


def _getter(idx: Sequence[int]) -> Any:
    """``args -> tuple(args[i] for i in idx)``, in C."""
    if not idx:
        return lambda args: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*idx)


@boxed_convention
class CaptureEngine:
    """Captures and replays one static FX graph (see the module docstring); boxed: called
    with one list of inputs."""

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext,
                 device: torch.device, compile_static: StaticCompiler | None = None,
                 native_warmup: bool = False, frozen: bool = False) -> None:
        self.gm = gm
        self.compile_static = compile_static
        # ``compile_static`` makes the static inputs constants of its code: one per set
        self.frozen = frozen
        # the compile cache's loaded code on the CPU (``gm`` may be the dynamic graph):
        # a warm-up inside precompile_gears, whose outputs are dropped and whose input
        # writes are undone, is skipped (the code's first run is then the capture, as in
        # the process that compiled it, where the warm-up ran the FX graph); a warm-up a
        # caller sees runs the FX graph, as there, so its outputs are the same bit for bit
        self.native_warmup = native_warmup and device.type == "cpu"
        self.ctx = ctx
        self.record = ctx.record
        self.device = device
        cc = ctx.config.capture_config
        self.cc = cc
        self.group = _group(ctx)
        self.pool = _pool_for(ctx, self.group)
        self.private_pool = self.pool is not self.group.pool and cc.use_custom_pool is None
        n = len(example_inputs)
        tensors = [i for i, a in enumerate(example_inputs) if isinstance(a, torch.Tensor)]
        # AOT's static indices describe forward/inference inputs; a backward graph's
        # inputs are saved activations and gradients: all of them are copied.
        static = set() if ctx.stage == "backward" else {i for i in ctx.static_inputs if i < n}
        mutated = {i for i in ctx.mutated_inputs if i < n}
        self.static_idx = sorted(i for i in tensors if i in static and i not in mutated)
        self.mutated_idx = sorted(i for i in tensors if i in mutated)
        others = [i for i in tensors if i not in static and i not in mutated]
        self.copy_idx = others if cc.clone_input else []
        # inputs used in place (their address is part of the capture)
        self.tracked_idx = self.mutated_idx + ([] if cc.clone_input else others)
        # frozen_parameter: static inputs keyed by which tensors they are (their addresses
        # are promised fixed), else by address
        self.key_by_identity = ctx.config.experimental_config.frozen_parameter
        self._statics = _getter(self.static_idx)
        self.scalar_idx = [i for i in range(n) if i not in tensors]
        self.rebindable = device.type == "cpu"
        self.collectives = find_collectives(gm)
        self.clone_output = cc.clone_output or ctx.stage in ("forward", "backward")
        self.entries: dict[tuple[Any, ...], _Entry] = {}
        self._executors: dict[tuple[int, ...], tuple[tuple[Any, ...], Any, tuple[int, ...]]] = {}
        self._staging: dict[tuple[int, int], torch.Tensor] = {}
        self._lock = threading.RLock()
        self._safe_warned = False
        self._stale = self._stale_msg()  # built once: it is passed on every replay
        self.calls = 0
        self.serial = next(_serial)
        register_release(self)

    # ---- keys and entries ------------------------------------------------------------
    def _static_key(self, args: Sequence[Any]) -> tuple[int, ...]:
        return tuple(map(id if self.key_by_identity else _DATA_PTR, self._statics(args)))

    def _key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        key = (threading.get_ident(), self._static_key(args),
               tuple(args[i] for i in self.scalar_idx) if self.scalar_idx else ())
        if not self.rebindable:
            key += (tuple(args[i].data_ptr() if isinstance(args[i], torch.Tensor) else None
                          for i in self.tracked_idx),)
        return key

    def _new_entry(self, key: tuple[Any, ...]) -> _Entry:
        with self._lock:
            self._release_dead()
            e = _Entry()
            if not self.rebindable and any(k[:3] == key[:3] for k in self.entries):
                e.warm = self.cc.warmup_iters  # same code, inputs moved: no new warm-up
                e.recapture = True
            self.entries[key] = e
        return e

    def _release_dead(self) -> None:
        """Release the captures of threads that ended, and this thread's captures whose
        inputs bound in place died (another thread's are its own to release)."""
        alive = {t.ident for t in threading.enumerate()}
        me = threading.get_ident()
        for k, e in list(self.entries.items()):
            if k[0] in alive and not (k[0] == me and any(r.expired() for r in e.bound_refs)):
                continue
            if e.graph is not None:
                e.graph.release()
                with self.group.lock:
                    self.group.captures -= 1
            del self.entries[k]
        for k in [k for k in self._staging if k[0] not in alive]:
            del self._staging[k]
        self.pool.prune(alive)

    # ---- the call --------------------------------------------------------------------
    def __call__(self, args: list[Any]) -> list[Any]:
        self.calls += 1
        arena = self.pool.arena()
        if arena.handed:
            self.pool.recycle(arena)  # outputs the caller dropped: handed out again
            if self.tracked_idx and arena.handed:
                self._stage_fed_back(args)
        key = self._key(args)
        e = self.entries.get(key)
        if e is None:
            e = self._new_entry(key)
            if self.key_by_identity:
                e.statics = self._statics(args)
                e.params = _parameters(e.statics)
        g = e.graph
        if self.frozen and g is not None and tuple(map(_VERSION, e.params)) != e.versions:
            e, g = self._weights_written(key, args), None
        if g is None:
            if e.uncaptured:
                return self._run_uncaptured(args)
            if e.warm < self.cc.warmup_iters:
                e.warm += 1
                self.record.uncaptured_runs += 1
                return self._warmup(args)
            return self._capture(e, args)
        bound = g.args
        if g.released:  # graphgear.reset() in another thread since the lookup
            return self._run_uncaptured(args)
        if e.bound_refs and any(r.expired() for r in e.bound_refs):
            # a new tensor at the address a dead one was captured with: it is this
            # capture's now (the graph writes that address), not a dead capture
            e.bound_refs = [StorageWeakRef(args[i].untyped_storage()) for i in self.tracked_idx
                            if isinstance(args[i], torch.Tensor)]
        if self.rebindable:
            moved = False
            for i in self.tracked_idx:
                a = args[i]
                if a is not bound[i] and not _same_memory(a, bound[i]):
                    g.rebind(i, a)  # a new KV cache: same code, same record
                    moved = True
            if moved:
                self.record.rebinds += 1
        for i in e.copy_idx:
            bound[i].copy_(args[i])
        self.pool.invalidate(self._stale, arena)
        outs = g.replay()
        if outs is None:  # released by another thread before it ran
            return self._run_uncaptured(args)
        self.record.replays += 1
        return self._hand_out(e, outs, arena)

    def _weights_written(self, key: tuple[Any, ...], args: list[Any]) -> _Entry:
        """The static inputs of frozen code were written in place since it was made (their
        version counters moved): drop that code and every capture of it (each thread's),
        and start ``key`` again; it warms up on the new values and captures new code."""
        which = self._static_key(args)
        log.info("graphgear: %s: frozen weights were written in place since its code was made; "
                 "compiling it again from the new values", self.record.name)
        with self._lock:
            self._executors.pop(which, None)
            for k, other in list(self.entries.items()):
                if other.statics and tuple(map(id, other.statics)) == which:
                    if other.graph is not None:
                        other.graph.release()
                        with self.group.lock:
                            self.group.captures -= 1
                    del self.entries[k]
        e = self._new_entry(key)
        e.statics = self._statics(args)
        e.params = _parameters(e.statics)
        return e

    def _run_uncaptured(self, args: list[Any]) -> list[Any]:
        """Run the FX graph as it is (a key that runs uncaptured, past capture_limit, or
        whose capture another thread's ``graphgear.reset()`` released before its replay)."""
        self.record.uncaptured_runs += 1
        return list(self.gm(*args))

    def _stage_fed_back(self, args: list[Any]) -> None:
        """An input used in place that is a live output of this pool (an output fed back
        in, ``clone_input=False``) would be overwritten while the graph reads it: copy it
        to a buffer of its own first."""
        live = self.pool.handed_ptrs()
        if not live:
            return
        for i in self.tracked_idx:
            a = args[i]
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in live:
                args[i] = self._stage(i, a)

    def _stage(self, i: int, a: torch.Tensor) -> torch.Tensor:
        """A buffer of this thread's own, with a stable address, holding a copy of ``a``."""
        k = (threading.get_ident(), i)
        buf = self._staging.get(k)
        if buf is None or buf.size() != a.size() or buf.stride() != a.stride() or buf.dtype != a.dtype:
            buf = torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
            self._staging[k] = buf
        buf.copy_(a)
        return buf

    def _input_name(self, i: int) -> str:
        names = self.ctx.input_names
        return repr(names[i]) if i < len(names) else f"#{i}"

    def _warmup(self, args: list[Any]) -> list[Any]:
        if self.device.type in ("cuda", "npu"):
            graph = self._device_graph(args)
            return graph.warmup(list(args))
        if self.native_warmup:
            state = precompiling()
            if state is not None and state.get("discard"):
                return []
        return list(self.gm(*args))

    def _executor_for(self, args: list[Any]) -> Any:
        which = self._static_key(args) if self.frozen else ()
        statics = self._statics(args) if self.frozen else ()
        # frozen code holds the values the parameters had: made again once written
        versions = tuple(map(_VERSION, _parameters(statics)))
        made = self._executors.get(which)
        if made is None or made[2] != versions:
            # dynamo's compile lock first, then this engine's (the order dispatch uses)
            with compile_session(), self._lock:
                made = self._executors.get(which)
                if made is None or made[2] != versions:
                    # (with the static inputs it was made for: their ids stay theirs)
                    made = self._executors[which] = (statics, self._compile(args), versions)
        return made[1]

    def _device_graph(self, args: list[Any]) -> Any:
        kw = dict(pool=self.pool, name=self.record.name)
        executor = self._executor_for(args)
        if self.device.type == "cpu":
            return CPUGraph(executor, **kw)
        if self.device.type == "cuda":
            return CUDAGraph(executor, device=self.device, mutated_idx=self.mutated_idx, **kw)
        return NPUGraph(executor, device=self.device, mutated_idx=self.mutated_idx, **kw)

    def _compile(self, args: list[Any]) -> Any:
        """The code the captures of this graph run (compiled once per engine, or per set
        of static inputs where it holds their values)."""
        kw = dict(stage=self.ctx.stage, static_idx=self.static_idx, name=self.record.name,
                  compile_static=self.compile_static)
        if self.device.type == "cpu":
            return CPUExecutor(self.gm, args, **kw)
        if self.device.type == "cuda":
            return cuda_executor(self.gm, args, **kw)
        if self.device.type == "npu" and npu_available():
            return npu_executor(self.gm)
        raise CaptureError(
            f"graphgear: reduce-overhead has no device graph for device {self.device} "
            f"(graph {self.record.name}); supported: cpu, cuda, npu (with torch_npu). "
            f"Use mode='max-autotune' for this device."
        )

    def _limit_reached(self) -> bool:
        """Whether the FX graph's capture_limit forbids one more capture; takes a slot
        when it does not."""
        with self.group.lock:
            if self.group.captures < self.cc.capture_limit:
                self.group.captures += 1
                return False
            first = not self.group.limit_warned
            self.group.limit_warned = True
        reason = f"capture_limit={self.cc.capture_limit} reached: further graph keys run uncaptured"
        self.record.add_fallback("capture_limit", reason)
        if first:
            warn(
                f"graphgear: {self.record.name} ({self.ctx.stage}) reached "
                f"capture_config.capture_limit={self.cc.capture_limit} live captured graphs; "
                f"new graph keys (sizes, threads, addresses of inputs used in place, parameter "
                f"addresses, or models) run uncaptured from now on. To capture them, raise "
                f"capture_limit, or limit the sizes with graphgear.set_dim_gears(...)."
            )
        return True

    def _capture(self, e: _Entry, args: list[Any]) -> list[Any]:
        if self._limit_reached():
            e.uncaptured = True
            return self._run_uncaptured(args)
        bound = list(args)
        nbytes = 0
        e.copy_idx = [i for i in self.copy_idx if isinstance(args[i], torch.Tensor)]
        for i in e.copy_idx:
            a = args[i]
            if not has_internal_overlap(a):  # keep its layout
                buf = torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
            else:  # expanded or overlapping: a dense buffer of the same shape
                buf = torch.empty(a.size(), dtype=a.dtype, device=a.device)
            buf.copy_(a)
            bound[i] = buf
            nbytes += nbytes_of(a.size(), a.stride(), a.dtype)
        self.pool.invalidate(self._stale)
        if not self.clone_output and liveness.poisoner() is None:
            self._enter_safe_mode()
        e.versions = tuple(map(_VERSION, e.params)) if self.frozen else ()
        graph = self._device_graph(bound)
        snapshot = ({i: args[i].clone() for i in self.mutated_idx if isinstance(args[i], torch.Tensor)}
                    if graph.runs_at_capture else {})
        try:
            outs = graph.capture(bound)
            if outs is None:
                outs = graph.replay()
        except BaseException as ex:
            graph.release()
            with self.group.lock:
                self.group.captures -= 1
            for i, saved in snapshot.items():  # undo what the failed run wrote
                args[i].copy_(saved)
            if not isinstance(ex, Exception):
                # KeyboardInterrupt, SystemExit: the inputs are as passed, the slot is
                # free, the next call captures again
                raise
            return self._capture_failed(e, args, ex, ran=graph.runs_at_capture)
        self.pool.add_bytes(nbytes)
        e.graph = graph
        if not self.rebindable:
            e.bound_refs = [StorageWeakRef(args[i].untyped_storage()) for i in self.tracked_idx
                            if isinstance(args[i], torch.Tensor)]
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
        self.record.pool_bytes = max(self.record.pool_bytes, self.pool.nbytes)
        log.info("graphgear: captured %s (%s) on %s: %d bytes", self.record.name,
                 self.ctx.stage, self.device, graph.nbytes + nbytes)
        return self._hand_out(e, outs)

    def _capture_failed(self, e: _Entry, args: list[Any], ex: Exception, *, ran: bool) -> list[Any]:
        """The inputs are as the caller passed them. ``fallback='raise'`` raises; else
        the graph runs once uncaptured: if that raises too, the error is the graph's own
        and reaches the caller (the next call tries to capture again); if not, this key
        runs uncaptured from now on.

        A graph with collectives whose failed capture ran (``ran``: the CPU graph's
        capture runs the graph) is not run again: its collectives may have been issued
        already, and issuing them twice would put this rank out of step with the others
        (a hang or wrong sums). Its error reaches the caller as it is; the next call
        tries to capture again."""
        reason = f"capture failed: {type(ex).__name__}: {ex}"
        if self.cc.fallback == "raise":
            self.record.add_fallback("capture", reason)
            raise CaptureError(
                f"graphgear: could not capture {self.record.name} ({self.ctx.stage}) on "
                f"{self.device}: {reason}. The inputs are unchanged. "
                f"capture_config.fallback='raise' forbids running it uncaptured; set "
                f"fallback='eager' to run it uncaptured."
            ) from ex
        if ran and self.collectives:
            log.warning("graphgear: capture of %s (%s) failed after running its collectives (%s): "
                        "%s; not run again uncaptured (that would issue them twice on this rank "
                        "only); the error reaches the caller.", self.record.name, self.ctx.stage,
                        ", ".join(self.collectives), reason)
            raise ex
        self.record.uncaptured_runs += 1
        outs = list(self.gm(*args))  # raises the graph's own error, once
        self.record.add_fallback("capture", reason)
        warn(f"graphgear: could not capture {self.record.name} ({self.ctx.stage}) on "
             f"{self.device}: {reason}. It runs uncaptured from now on; see "
             f"graphgear.stats() for the reason.")
        e.uncaptured = True
        return outs

    def _enter_safe_mode(self) -> None:
        self.clone_output = True
        if not self._safe_warned:
            self._safe_warned = True
            warn(f"graphgear: {self.record.name}: this process cannot mark overwritten outputs "
                 f"(no output-liveness support, see the log); reduce-overhead returns copies of "
                 f"its outputs instead (as capture_config.clone_output=True): correct, a little "
                 f"slower.")

    def _stale_msg(self) -> str:
        return (
            f"graphgear: this tensor is an output of the reduce-overhead graph "
            f"{self.record.name} ({self.ctx.stage}), and a later replay of a graph in the same "
            f"memory pool has overwritten it. Clone outputs you keep before calling the "
            f"compiled model again (out.clone()), or set capture_config.clone_output=True."
        )

    def _hand_out(self, e: _Entry, outs: list[Any], arena: Any = None) -> list[Any]:
        if self.clone_output:
            return [o.clone() if isinstance(o, torch.Tensor) else o for o in outs]
        res = list(outs)
        pool = self.pool
        last = e.handouts
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
            for e in self.entries.values():
                if e.graph is not None:
                    e.graph.release()
                    with self.group.lock:
                        self.group.captures -= 1
            self.entries.clear()
            self._staging.clear()
            self._executors.clear()
        self.pool.release()
        with self.group.lock:
            self.group.captures = max(0, self.group.captures)
            self.group.limit_warned = False

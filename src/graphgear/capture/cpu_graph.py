"""graphgear's CPU graph: capture once, replay without Python per op.

PyTorch has no CPU graph. graphgear's works like a device graph:

* **capture** compiles the static graph of one graph key to native code once (Inductor's
  C++ code generation, on a graph re-traced with Inductor's decompositions, with tiny
  matrix products (one row, as in batch-1 decoding) lowered to fused C++ loops instead of
  ATen ``mm`` calls), then runs it once while *recording* every buffer it allocates: the
  ``k``-th allocation is the pool's block ``k``. Inputs are bound to static buffers.
* **replay** copies the user inputs into the static buffers and runs the native code
  again with the allocator replaced by the record: it allocates nothing, and its
  intermediates and outputs land in the same pool memory as at capture. Outputs that
  the generated code does not allocate itself (an ATen kernel's result) are copied into
  a static output buffer, so every output lives in pool memory and is overwritten by
  the next replay, exactly as on a device.

Where Inductor's generated Python is straight-line code (allocations, views, generated
C++ kernels, ``extern_kernels`` products with ``out=``: the common case for decode steps
at one row and for graphs without packed weights), the capture also reads it
(``capture.program.inductor_straight_line``) and evaluates it once on the record into a fixed list
of kernel calls (:class:`_Program`): a replay then only calls the kernels, with no
allocation, view or Python frame of the generated code (the tiny served decoder's step:
0.69x; the small one's: 0.91x).

The generated code takes every buffer as an argument, so an input the graph mutates in
place (a KV cache) that moved is *rebound* (:meth:`CPUGraph.rebind`): no new record, no
new compile. The code is compiled once per static graph (:class:`CPUExecutor`, shared by
every capture of it, also across threads) and cached on disk by Inductor
(``TORCHINDUCTOR_CACHE_DIR``), so a second process captures in about a second.

The record replaces the allocator of Inductor's generated module through a thread-local
switch installed once in that module (:func:`_allocator_switch`): concurrent replays in
different threads, and other users of the same generated module, never see each other's
record. When Inductor cannot compile a graph the CPU graph records the FX graph itself
(same memory rules, no speed-up) and says so.

Why this hook: Inductor's Python wrapper makes every allocation of a run through one
function (``empty_strided_cpu``), so serving that function from the record is the one
place where a whole replay runs in recorded memory without changing the generated code.
Inductor's own ``memory_planning`` reuses buffers within one run but still allocates
every run. Inductor's C++ wrapper (``cpp_wrapper``) moves allocation into C++, out of
reach: the compiler chooses it only where it pays, for graphs whose matrix products are
extern calls (``compilers.inductor.compile_static``: frozen decode batches of 2 rows and
more), and a replay of such code allocates its intermediates in C++ and copies its
outputs into static buffers (the same rules for what is handed out). Where the allocator
is not found in a Python wrapper (a future Inductor), the CPU graph says so in a warning
and runs the same way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from .._torch.inductor import (
    INDUCTOR_ALLOC_NAMES,
    inductor_callable,
    inductor_is_cpp_wrapper,
    inductor_wrapper_globals,
)
from ..errors import REPORT_BUG
from .pool import Arena, MemoryPool
from .program import StraightLine, inductor_straight_line

log = logging.getLogger(__name__)

__all__ = ["CPUExecutor", "CPUGraph", "nbytes_of"]

def nbytes_of(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> int:
    if any(s == 0 for s in size):
        return 0
    span = 1 + sum((s - 1) * st for s, st in zip(size, stride))
    return span * dtype.itemsize


_SWITCH_LOCK = threading.Lock()


def _allocator_switch(g: dict[str, Any], name: str) -> threading.local:
    """Install (once per generated module) an allocator that asks a thread-local slot
    first: ``slot.fn`` set means "this thread is recording or replaying a CPU graph",
    unset means Inductor's own allocator. Returns the slot."""
    with _SWITCH_LOCK:
        cur = g[name]
        slot = getattr(cur, "graphgear_slot", None)
        if slot is not None:
            return slot
        slot = threading.local()
        original = cur

        def alloc(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
            fn = getattr(slot, "fn", None)
            if fn is None:
                return original(size, stride, dtype)
            return fn(size, stride, dtype)

        alloc.graphgear_slot = slot  # type: ignore[attr-defined]
        g[name] = alloc
        return slot


class CPUExecutor:
    """The compiled code of one static graph as the CPU graph runs it, shared by all its
    captures: Inductor's generated ``call`` (``compiled``; None where Inductor could not
    compile the graph: the FX graph ``gm`` itself), the thread-local allocator slot of its
    module, and its straight-line reading where there is one."""

    def __init__(self, compiled: Callable[[list[Any]], Any] | None, gm: fx.GraphModule, name: str) -> None:
        self.native = False
        self.slot: threading.local | None = None
        self.straight: StraightLine | None = None
        g = inductor_wrapper_globals(compiled) if compiled is not None else None
        if compiled is not None:
            self.native = True
            self.run: Callable[[list[Any]], Any] = inductor_callable(compiled)
            if g is not None:
                self.slot = _allocator_switch(g, next(n for n in INDUCTOR_ALLOC_NAMES if n in g))
                self.straight = inductor_straight_line(compiled)
                log.debug("graphgear: %s: generated code %s", name,
                          "replays as a list of kernel calls" if self.straight is not None
                          else "is not straight-line; each replay runs it")
            elif inductor_is_cpp_wrapper(compiled):
                # Inductor's C++ wrapper (chosen by the compiler for graphs of many extern
                # calls): it allocates in C++; the outputs are copied to static buffers
                log.debug("graphgear: %s: C++ wrapper; outputs copied to static buffers", name)
            else:  # Inductor changed its wrapper: say so, and keep the memory rules
                log.warning(
                    "graphgear: %s: Inductor's generated code has no allocator named %s to "
                    "record (has Inductor changed its Python wrapper?); the CPU graph runs "
                    "the native code without a record, allocating per replay, and copies "
                    "its outputs to static buffers.", name, " or ".join(INDUCTOR_ALLOC_NAMES))
        else:
            self.run = lambda a: gm(*a)


class CPUGraph:
    """One captured static graph on the CPU (see the module docstring)."""

    device = torch.device("cpu")
    #: capture runs the graph for real (inputs it mutates are written)
    runs_at_capture = True
    #: a moved input bound in place is rebound, not captured again
    rebindable = True

    def __init__(self, executor: CPUExecutor, *, pool: MemoryPool, name: str) -> None:
        self.executor = executor
        self.pool = pool
        self.name = name
        self.args: list[Any] = []
        self.record: list[torch.Tensor] = []
        self.native = executor.native
        self._out_copy: list[tuple[int, torch.Tensor]] = []
        # the replay as a list of kernel calls (straight-line generated code), or None
        self.program: _Program | None = None
        self._arena: Arena | None = None
        self.nbytes = 0
        self.released = False

    # ---- capture -------------------------------------------------------------------
    def capture(self, args: list[Any]) -> list[Any]:
        """Bind ``args`` (static buffers and static inputs) and run once while recording
        allocations; returns this run's (static) outputs."""
        self.args = args
        outs = self._record_run()
        # outputs the generated code did not allocate from the pool: static copies
        pool_ptrs = {t.untyped_storage().data_ptr() for t in self.record}
        arg_ptrs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        self._out_copy = []
        result = list(outs)
        for i, o in enumerate(result):
            if not isinstance(o, torch.Tensor):
                continue
            ptr = o.untyped_storage().data_ptr()
            if ptr in pool_ptrs or ptr in arg_ptrs:
                continue
            static = torch.empty_strided(o.size(), o.stride(), dtype=o.dtype, device=o.device)
            static.copy_(o)
            self.nbytes += nbytes_of(o.size(), o.stride(), o.dtype)
            self._out_copy.append((i, static))
            result[i] = static
        self.program = self._build_program(outs)
        return result

    def _record_run(self) -> list[Any]:
        ex = self.executor
        slot = ex.slot
        if slot is None:
            return list(ex.run(list(self.args)))
        self.record = []
        # one arena for the whole capture: graphgear.reset() in another thread may
        # release the pool meanwhile; this capture then completes in its own memory
        pool, record, arena = self.pool, self.record, self.pool.arena()
        self._arena = arena

        def recording_alloc(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
            n = nbytes_of(size, stride, dtype)
            blk = pool.block(len(record), n, self.device, arena)
            t = torch.empty((), dtype=dtype).set_(blk, 0, tuple(size), tuple(stride))
            pool.register(len(record), t, arena)
            record.append(t)
            return t

        slot.fn = recording_alloc
        try:
            outs = list(ex.run(list(self.args)))
        finally:
            slot.fn = None
        self.nbytes += sum(nbytes_of(t.size(), t.stride(), t.dtype) for t in record)
        return outs

    def _build_program(self, outs: Sequence[Any] | None = None) -> _Program | None:
        """The replay as a list of kernel calls on the bound arguments and the record,
        where the generated code is straight-line (``capture.program.inductor_straight_line``);
        None otherwise, or where reading it does not give back the capture's own
        allocations (size, strides, dtype, count) and outputs (memory, size, strides)."""
        sl, arena = self.executor.straight, self._arena
        if sl is None or arena is None or self.released:
            return None
        try:
            prog = _Program.build(sl, self.args, self.record)
        except (KeyError, StopIteration, RuntimeError, TypeError, ValueError) as e:
            log.debug("graphgear: %s: no kernel-call replay (%s: %s)", self.name, type(e).__name__, e)
            return None
        if prog is None:
            return None
        if outs is not None and not prog.same_outputs(outs):
            log.debug("graphgear: %s: no kernel-call replay (its outputs differ from the capture's)", self.name)
            return None
        for index, view in prog.views:  # a block that grows moves these views with it
            self.pool.register(index, view, arena)
        return prog

    def rebind(self, i: int, t: torch.Tensor) -> None:
        """Bind argument ``i`` to ``t`` from the next replay on (the kernel-call replay
        is rebuilt on it). ``t`` must have the bound tensor's size, strides, dtype and
        device: the code was compiled for them."""
        old = self.args[i]
        if isinstance(old, torch.Tensor) and (
                t.size() != old.size() or t.stride() != old.stride() or t.dtype != old.dtype
                or t.device != old.device):
            raise RuntimeError(
                f"graphgear: the CPU graph of {self.name} was captured with input #{i} of size "
                f"{tuple(old.size())}, strides {old.stride()}, {old.dtype} on {old.device}; it was "
                f"called with size {tuple(t.size())}, strides {t.stride()}, {t.dtype} on {t.device} "
                f"at a new address. Its code is compiled for the first layout, and dynamo's guards "
                f"should have sent this call to another graph: this is a graphgear bug; {REPORT_BUG}. "
                f"Until then pass the input with the layout it was captured with (for example "
                f".contiguous()).")
        self.args[i] = t
        prog = self.program
        if prog is not None and not prog.rebind(i, t):
            self.program = self._build_program()

    # ---- replay --------------------------------------------------------------------
    def replay(self) -> list[Any] | None:
        """Run the record on the static buffers; returns the static outputs, or None
        when :meth:`release` (``graphgear.reset()`` in another thread) came first.

        The bound inputs, the record and the output copies are read once: a release
        meanwhile replaces them (it never empties them in place), so this replay runs
        whole on what it read, in memory its record keeps alive."""
        args, record, out_copy, prog = self.args, self.record, self._out_copy, self.program
        if self.released:
            return None
        ex = self.executor
        slot = ex.slot
        if prog is not None:
            for fn, a, kw in prog.calls:
                if kw is None:
                    fn(*a)
                else:
                    fn(*a, **kw)
            outs = list(prog.outs)
        elif slot is None:
            outs = list(ex.run(list(args)))
        else:
            it = iter(record)
            nxt = it.__next__
            slot.fn = lambda size, stride, dtype: nxt()
            try:
                outs = list(ex.run(list(args)))
            except StopIteration as e:
                raise RuntimeError(self._diverged()) from e
            finally:
                slot.fn = None
            if next(it, None) is not None:
                raise RuntimeError(self._diverged())
        for i, static in out_copy:
            static.copy_(outs[i])
            outs[i] = static
        return outs

    def _diverged(self) -> str:
        return (f"graphgear: the CPU graph of {self.name} allocated differently on replay than at "
                f"capture ({len(self.record)} buffers recorded); its outputs are not trustworthy. "
                f"This is a graphgear bug; {REPORT_BUG}. Until then set capture_config.fallback='eager' "
                f"with debug.run_eagerly=True to work around it.")

    def release(self) -> None:
        """Drop the record and the bound inputs (replaced, not emptied in place: see
        :meth:`replay`)."""
        self.released = True
        self.args = []
        self.record = []
        self._out_copy = []
        self.program = None


class _Program:
    """A capture's replay as a fixed list of kernel calls: the generated code read as
    straight-line code (:class:`~graphgear.capture.program.StraightLine`) and evaluated once on
    the bound arguments and the record. A replay then calls each kernel on the same
    tensors, with no allocation, view or Python frame of the generated code per replay.

    ``views``: the views it made of record buffers, with their block index (the pool
    moves them with the block when it grows, as it moves the record).

    ``slots``: per bound argument, where the calls take it or a view of it (call,
    position or keyword, and the view's size, strides and storage offset relative to
    the argument), so that :meth:`rebind` re-points those calls at a moved argument
    without reading the code again (a beam search moves the KV cache at every step:
    reading the code again cost the tiny served Qwen2 about 240 µs per moved tensor);
    ``raw``: the generated code's own call, before ``graphgear_direct`` rewrote it, of
    the calls that take an argument; ``rigid``: the arguments an output is or views
    (those need the whole program again)."""

    __slots__ = ("calls", "outs", "raw", "rigid", "slots", "views")

    def __init__(self, calls: list[tuple[Any, tuple[Any, ...], dict[str, Any] | None]],
                 outs: list[Any], views: list[tuple[int, torch.Tensor]],
                 slots: dict[int, list[tuple[int, int | str, Any, Any, int, bool]]] | None = None,
                 raw: dict[int, tuple[Any, tuple[Any, ...], dict[str, Any] | None]] | None = None,
                 rigid: set[int] | None = None) -> None:
        self.calls = calls
        self.outs = outs
        self.views = views
        self.slots = slots or {}
        self.raw = raw or {}
        self.rigid = rigid or set()

    @classmethod
    def build(cls, sl: StraightLine, args: Sequence[Any], record: Sequence[torch.Tensor]) -> _Program | None:
        idx = list(range(len(args))) if sl.keep is None else list(sl.keep)
        passed = [args[i] for i in idx]
        if len(passed) != len(sl.params):
            return None
        env: dict[str, Any] = dict(zip(sl.params, passed))
        block: dict[str, int] = {}  # local name -> record block its memory is
        origin = {n: i for n, i in zip(sl.params, idx) if isinstance(env[n], torch.Tensor)}  # name -> argument
        views: list[tuple[int, torch.Tensor]] = []
        slots: dict[int, list[tuple[int, int | str, Any, Any, int, bool]]] = {}
        raw: dict[int, tuple[Any, tuple[Any, ...], dict[str, Any] | None]] = {}
        rigid: set[int] = set()

        def view(src: str, size: Any, stride: Any, offset: int) -> torch.Tensor:
            v = sl.reinterpret(env[src], size, stride, offset)
            if src in block:
                views.append((block[src], v))
            return v

        def value(spec: tuple[Any, ...]) -> Any:
            if spec[0] == "name":
                return env[spec[1]]
            if spec[0] == "value":
                return spec[1]
            return view(*spec[1:])

        def argument_of(spec: tuple[Any, ...]) -> int | None:
            return None if spec[0] == "value" else origin.get(spec[1])

        calls: list[tuple[Any, tuple[Any, ...], dict[str, Any] | None]] = []
        k = 0
        for st in sl.steps:
            kind = st[0]
            if kind == "alloc":
                if k >= len(record):
                    return None
                t = record[k]
                if tuple(t.size()) != tuple(st[2]) or tuple(t.stride()) != tuple(st[3]) or t.dtype != st[4]:
                    return None
                env[st[1]] = t
                block[st[1]] = k
                k += 1
            elif kind in ("view", "alias"):
                env[st[1]] = view(*st[2:]) if kind == "view" else env[st[2]]
                if st[2] in block:
                    block[st[1]] = block[st[2]]
                if st[2] in origin:
                    origin[st[1]] = origin[st[2]]
            elif kind == "del":
                for name in st[1]:
                    env.pop(name, None)
                    block.pop(name, None)
                    origin.pop(name, None)
            else:
                kw = {n: value(v) for n, v in st[3].items()} or None
                fn, call_args = st[1], tuple(value(a) for a in st[2])
                uses = [(argument_of(spec), key, t) for key, spec, t in
                        [*zip(range(len(st[2])), st[2], call_args),
                         *((n, st[3][n], kw[n]) for n in (kw or {}))]]
                uses = [(j, key, t) for j, key, t in uses if j is not None and isinstance(t, torch.Tensor)]
                for j, key, t in uses:
                    base = args[j]
                    slots.setdefault(j, []).append((len(calls), key, t.size(), t.stride(),
                                                    t.storage_offset() - base.storage_offset(), t is base))
                # an extern kernel that names the built kernel it runs (graphgear's own
                # kernels): call that kernel itself
                direct = getattr(fn, "graphgear_direct", None)
                if direct is not None:
                    if uses:
                        raw[len(calls)] = (fn, call_args, kw)
                    fn, call_args, kw = direct(call_args, kw)
                calls.append((fn, call_args, kw))
        if k != len(record):
            return None
        rigid.update(j for j in (argument_of(o) for o in sl.outs) if j is not None)
        outs = [value(o) for o in sl.outs]
        return cls(calls, outs, views, slots, raw, rigid)

    def rebind(self, j: int, t: torch.Tensor) -> bool:
        """Point the calls that take bound argument ``j`` (or views of it) at ``t``, which
        has its size, strides and dtype; False where only building the program again
        can (see ``rigid``) or a view does not fit in ``t``'s storage."""
        if j in self.rigid:
            return False
        todo = self.slots.get(j, ())
        base = t.storage_offset()
        new = []
        try:
            for _c, _key, size, stride, delta, whole in todo:
                new.append(t if whole else t.as_strided(size, stride, base + delta))
        except RuntimeError:  # out of t's storage: the full build decides
            return False
        calls, raw = self.calls, self.raw
        changed: dict[int, tuple[Any, tuple[Any, ...], dict[str, Any] | None]] = {}
        for (c, key, *_), v in zip(todo, new):
            fn, a, kw = changed.get(c) or raw.get(c) or calls[c]
            if isinstance(key, int):
                a = a[:key] + (v,) + a[key + 1:]
            else:
                kw = {**(kw or {}), key: v}
            changed[c] = (fn, a, kw)
        try:
            for c, (fn, a, kw) in changed.items():
                if c in raw:  # the generated code's call: rewritten (and checked) again
                    raw[c] = (fn, a, kw)
                    fn, a, kw = fn.graphgear_direct(a, kw)
                calls[c] = (fn, a, kw)
        except (RuntimeError, TypeError, ValueError):  # a check refused it: the full build
            return False  # decides (and replaces this program), as at capture
        return True

    def same_outputs(self, outs: Sequence[Any]) -> bool:
        """Whether these are the capture's outputs: same memory, size, strides, dtype."""
        if len(outs) != len(self.outs):
            return False
        for a, b in zip(self.outs, outs):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
                return False
            if (a.data_ptr(), a.size(), a.stride(), a.dtype) != (b.data_ptr(), b.size(), b.stride(), b.dtype):
                return False
        return True

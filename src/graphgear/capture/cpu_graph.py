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

from .._torch import (
    INDUCTOR_ALLOC_NAMES,
    inductor_callable,
    inductor_is_cpp_wrapper,
    inductor_wrapper_globals,
)
from .pool import MemoryPool

log = logging.getLogger(__name__)

__all__ = ["CPUExecutor", "CPUGraph", "StaticCompiler", "nbytes_of"]

def nbytes_of(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> int:
    if any(s == 0 for s in size):
        return 0
    span = 1 + sum((s - 1) * st for s, st in zip(size, stride))
    return span * dtype.itemsize


#: ``compile_static(gm, args, *, stage, static_idx)``: the native code of a static graph
#: (boxed callable), given by the reduce-overhead compiler (Inductor, ``compilers.inductor``)
StaticCompiler = Callable[..., Callable[[list[Any]], Any]]


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
    """The compiled code of one static graph, shared by all its captures: Inductor's
    generated ``call`` (or the FX graph where Inductor cannot compile it) and the
    thread-local allocator slot of its module."""

    def __init__(self, gm: fx.GraphModule, args: Sequence[Any], *, stage: str,
                 static_idx: Sequence[int], name: str, compile_static: StaticCompiler | None) -> None:
        self.native = False
        self.slot: threading.local | None = None
        try:
            if compile_static is None:
                raise RuntimeError("no native compiler was given")
            compiled = compile_static(gm, args, stage=stage, static_idx=static_idx)
            g = inductor_wrapper_globals(compiled)
        except Exception as e:  # Inductor could not compile it: record the FX graph
            log.warning(
                "graphgear: %s: Inductor could not compile this graph for the CPU graph "
                "(%s: %s); capturing the FX graph itself (same memory rules, no speed-up).",
                name, type(e).__name__, e,
            )
            compiled, g = None, None
        if compiled is not None:
            self.native = True
            self.run: Callable[[list[Any]], Any] = inductor_callable(compiled)
            if g is not None:
                self.slot = _allocator_switch(g, next(n for n in INDUCTOR_ALLOC_NAMES if n in g))
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

    def rebind(self, i: int, t: torch.Tensor) -> None:
        """Bind argument ``i`` to ``t`` (same size and strides) from the next replay on."""
        self.args[i] = t

    # ---- replay --------------------------------------------------------------------
    def replay(self) -> list[Any] | None:
        """Run the record on the static buffers; returns the static outputs, or None
        when :meth:`release` (``graphgear.reset()`` in another thread) came first.

        The bound inputs, the record and the output copies are read once: a release
        meanwhile replaces them (it never empties them in place), so this replay runs
        whole on what it read, in memory its record keeps alive."""
        args, record, out_copy = self.args, self.record, self._out_copy
        if self.released:
            return None
        ex = self.executor
        slot = ex.slot
        if slot is None:
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
                f"This is a graphgear bug; report it, and set capture_config.fallback='eager' "
                f"with debug.run_eagerly=True to work around it.")

    def release(self) -> None:
        """Drop the record and the bound inputs (replaced, not emptied in place: see
        :meth:`replay`)."""
        self.released = True
        self.args = []
        self.record = []
        self._out_copy = []

"""The capture engine: device-neutral rules of ``mode="reduce-overhead"``.

One :class:`CaptureEngine` serves one static FX graph (the backend hands over one per
graph key: a static graph as it is, a dynamic graph specialised per key). It owns the
captured graphs of that graph and applies the rules of DESIGN.md:

* **key**: the graph key (fixed per engine) plus, unless ``frozen_parameter``, the
  addresses of the static inputs: a parameter that moved gets a capture of its own.
* **static inputs** (parameters, buffers, ``mark_static_address``) are bound at capture
  and never copied. **Mutated inputs** (KV caches) are used in place, never copied; when
  one moves, that capture is made again. **Other inputs** are copied into the capture's
  static buffers before each replay (``clone_input``; with ``clone_input=False`` they are
  bound in place like mutated inputs and a moved one is captured again).
* **warm-up**: ``warmup_iters`` uncaptured runs per capture before it is captured.
* **capture_limit**: at most that many captures per FX graph (all keys together); past
  it, new keys run uncaptured, with one warning and a ``stats()`` fallback entry.
* **outputs** live in the pool and are overwritten by the next replay in that pool;
  each is handed out through an alias that the next replay poisons, so reading a stale
  output raises ``RuntimeError`` naming the fix. ``clone_output`` returns fresh tensors
  (always done for training graphs, whose outputs are saved for backward or become
  gradients, and outlive the next replay).
* **what cannot be captured** (``debug.UNCAPTURABLE``: ``.item()``, data-dependent
  shapes, random numbers outside CUDA; CPU work inside a device graph; a capture that
  fails) follows ``fallback``: ``"eager"`` runs the graph uncaptured with one warning,
  ``"raise"`` raises :class:`graphgear.CaptureError`; ``stats()`` names op and reason.

The device graph itself (CPU, CUDA, NPU) is a small class with ``capture(args)``,
``replay()``, ``release()``, ``nbytes`` and ``args`` (the bound inputs).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from .. import debug
from ..errors import CaptureError
from ..stats import register_release
from .cpu_graph import CPUGraph, _nbytes
from .cuda_graph import CUDAGraph
from .npu_graph import NPUGraph, npu_available
from .pool import MemoryPool

if TYPE_CHECKING:
    from ..compilers.base import CompileContext

log = logging.getLogger(__name__)

__all__ = ["CaptureEngine", "CaptureGroup", "UncapturedGraph", "find_uncapturable", "graph_device"]


@dataclasses.dataclass
class CaptureGroup:
    """State shared by the engines of one FX graph (all its keys)."""

    pool: MemoryPool
    captures: int = 0
    limit_warned: bool = False


_CUSTOM_POOLS: dict[Any, MemoryPool] = {}
_serial = itertools.count()


def _group(ctx: CompileContext) -> CaptureGroup:
    group = getattr(ctx, "_graphgear_capture_group", None)
    if group is None:
        group = CaptureGroup(pool=MemoryPool(name=ctx.record.name))
        ctx._graphgear_capture_group = group  # type: ignore[attr-defined]
    return group


def _pool_for(ctx: CompileContext, group: CaptureGroup) -> MemoryPool:
    cc = ctx.config.capture_config
    custom = cc.use_custom_pool
    if custom is not None:
        if isinstance(custom, MemoryPool):
            return custom
        if custom not in _CUSTOM_POOLS:  # a raw device pool handle
            _CUSTOM_POOLS[custom] = MemoryPool(pool_id=custom, name=f"custom {custom}")
        return _CUSTOM_POOLS[custom]
    if cc.reuse_pool_across_gears:
        return group.pool
    return MemoryPool(name=f"{ctx.record.name} (private)")


def graph_device(example_inputs: Sequence[Any]) -> torch.device:
    """The device a graph runs on: its first non-CPU tensor input, else the CPU."""
    for a in example_inputs:
        if isinstance(a, torch.Tensor) and a.device.type not in ("cpu", "meta"):
            return a.device
    return torch.device("cpu")


_CONTROL_FLOW = {"cond", "while_loop", "higher_order.cond", "higher_order.while_loop"}


def find_uncapturable(gm: fx.GraphModule, device: torch.device) -> list[tuple[str, str]]:
    """``(op, reason)`` for every op of ``gm`` a ``device`` graph cannot hold."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    found: list[tuple[str, str]] = []
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        key = debug.op_key(n.target)
        reason = debug.UNCAPTURABLE.get(key)
        if reason is None and key in _CONTROL_FLOW:
            reason = "control flow that depends on the data: a graph replays one fixed path"
        if reason is not None:
            # CUDA graphs replay RNG safely: the generator's offset advances per replay.
            if not (device.type == "cuda" and reason.startswith("random numbers")):
                found.append((key, reason))
            continue
        val = n.meta.get("val")
        try:
            if val is not None and free_unbacked_symbols(val):
                found.append((key, "output shape depends on the data"))
                continue
        except Exception:
            pass
        if device.type != "cpu" and isinstance(val, torch.Tensor) and val.device.type == "cpu" \
                and val.numel() != 1:
            found.append((key, f"runs on the CPU inside a {device.type.upper()} graph"))
    return found


def _warn(msg: str) -> None:
    warnings.warn(msg, UserWarning, stacklevel=3)
    log.warning(msg)


class UncapturedGraph:
    """A graph ``fallback="eager"`` runs as it is, counting its runs."""

    _boxed_call = False

    def __init__(self, gm: fx.GraphModule, record: Any) -> None:
        self.gm = gm
        self.record = record

    def __call__(self, *args: Any) -> Any:
        self.record.uncaptured_runs += 1
        return self.gm(*args)


@dataclasses.dataclass
class _Entry:
    warm: int = 0
    graph: Any = None
    tracked_ptrs: tuple[int, ...] = ()
    uncaptured: bool = False
    alias_out: list[bool] = dataclasses.field(default_factory=list)


class CaptureEngine:
    """Captures and replays one static FX graph (see the module docstring)."""

    _boxed_call = True

    def __init__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext,
                 device: torch.device) -> None:
        self.gm = gm
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
        self.tracked_idx = self.mutated_idx + ([] if cc.clone_input else others)
        self.key_idx = [] if ctx.config.experimental_config.frozen_parameter else self.static_idx
        self.scalar_idx = [i for i in range(n) if i not in tensors]
        self.clone_output = cc.clone_output or ctx.stage in ("forward", "backward")
        self.entries: dict[tuple[Any, ...], _Entry] = {}
        self.calls = 0
        self.serial = next(_serial)
        register_release(self)

    # ---- keys and entries ------------------------------------------------------------
    def _key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        return (tuple(args[i].data_ptr() for i in self.key_idx),
                tuple(args[i] for i in self.scalar_idx))

    def _entry(self, key: tuple[Any, ...]) -> _Entry:
        e = _Entry()
        if self.group.captures >= self.cc.capture_limit:
            e.uncaptured = True
            reason = (f"capture_limit={self.cc.capture_limit} reached: further graph keys run "
                      "uncaptured")
            self.record.add_fallback("capture_limit", reason)
            if not self.group.limit_warned:
                self.group.limit_warned = True
                _warn(
                    f"graphgear: {self.record.name} ({self.ctx.stage}) reached "
                    f"capture_config.capture_limit={self.cc.capture_limit} captured graphs; "
                    f"new graph keys (sizes or parameter addresses) run uncaptured from now on. "
                    f"To capture them, raise capture_limit, limit the sizes with "
                    f"graphgear.set_dim_gears(...), or set "
                    f"experimental_config.frozen_parameter=True if parameters move."
                )
        self.entries[key] = e
        return e

    # ---- the call --------------------------------------------------------------------
    def __call__(self, args: list[Any]) -> list[Any]:
        self.calls += 1
        key = self._key(args)
        e = self.entries.get(key)
        if e is None:
            e = self._entry(key)
        g = e.graph
        if g is None:
            if e.uncaptured:
                self.record.uncaptured_runs += 1
                return list(self.gm(*args))
            if e.warm < self.cc.warmup_iters:
                e.warm += 1
                self.record.uncaptured_runs += 1
                return self._warmup(args)
            return self._capture(e, args)
        for i, p in zip(self.tracked_idx, e.tracked_ptrs):
            if args[i].data_ptr() != p:
                log.info("graphgear: %s: input %s moved; capturing again",
                         self.record.name, self._input_name(i))
                g.release()
                e.graph = None
                self.group.captures -= 1
                return self._capture(e, args)
        bound = g.args
        for i in self.copy_idx:
            bound[i].copy_(args[i])
        self.pool.invalidate(self._stale_msg())
        outs = g.replay()
        self.record.replays += 1
        return self._hand_out(e, outs)

    def _input_name(self, i: int) -> str:
        names = self.ctx.input_names
        return repr(names[i]) if i < len(names) else f"#{i}"

    def _warmup(self, args: list[Any]) -> list[Any]:
        if self.device.type in ("cuda", "npu"):
            return self._device_graph().warmup(list(args))
        return list(self.gm(*args))

    def _device_graph(self) -> Any:
        kw = dict(stage=self.ctx.stage, static_idx=self.static_idx, pool=self.pool,
                  name=self.record.name)
        if self.device.type == "cpu":
            return CPUGraph(self.gm, **kw)
        if self.device.type == "cuda":
            return CUDAGraph(self.gm, device=self.device, mutated_idx=self.mutated_idx, **kw)
        if self.device.type == "npu" and npu_available():
            return NPUGraph(self.gm, device=self.device, mutated_idx=self.mutated_idx, **kw)
        raise CaptureError(
            f"graphgear: reduce-overhead has no device graph for device {self.device} "
            f"(graph {self.record.name}); supported: cpu, cuda, npu (with torch_npu). "
            f"Use mode='max-autotune' for this device."
        )

    def _capture(self, e: _Entry, args: list[Any]) -> list[Any]:
        bound = list(args)
        nbytes = 0
        for i in self.copy_idx:
            a = args[i]
            if torch._debug_has_internal_overlap(a) == 0:  # no overlap: keep its layout
                buf = torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
            else:  # expanded or overlapping: a dense buffer of the same shape
                buf = torch.empty(a.size(), dtype=a.dtype, device=a.device)
            buf.copy_(a)
            bound[i] = buf
            nbytes += _nbytes(a.size(), a.stride(), a.dtype)
        self.pool.invalidate(self._stale_msg())
        if not self.clone_output:
            from . import liveness

            liveness.warm()  # build or load it now, not during a replay
        try:
            graph = self._device_graph()
            outs = graph.capture(bound)
            if outs is None:
                outs = graph.replay()
        except CaptureError:
            raise
        except Exception as ex:
            reason = f"capture failed: {type(ex).__name__}: {ex}"
            self.record.add_fallback("capture", reason)
            if self.cc.fallback == "raise":
                raise CaptureError(
                    f"graphgear: could not capture {self.record.name} ({self.ctx.stage}) on "
                    f"{self.device}: {reason}. capture_config.fallback='raise' forbids running "
                    f"it uncaptured; set fallback='eager' to run it uncaptured."
                ) from ex
            _warn(f"graphgear: could not capture {self.record.name} ({self.ctx.stage}) on "
                  f"{self.device}: {reason}. It runs uncaptured from now on; see "
                  f"graphgear.stats() for the reason.")
            e.uncaptured = True
            self.record.uncaptured_runs += 1
            return list(self.gm(*args))
        self.pool.add_bytes(nbytes)
        e.graph = graph
        e.tracked_ptrs = tuple(args[i].data_ptr() for i in self.tracked_idx)
        input_ptrs = {a.untyped_storage().data_ptr() for a in bound if isinstance(a, torch.Tensor)}
        e.alias_out = [isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in input_ptrs
                       for o in outs]
        self.group.captures += 1
        self.record.captures += 1
        self.record.pool_bytes = max(self.record.pool_bytes, self.pool.nbytes)
        log.info("graphgear: captured %s (%s) on %s: %d bytes", self.record.name,
                 self.ctx.stage, self.device, graph.nbytes + nbytes)
        return self._hand_out(e, outs)

    def _stale_msg(self) -> str:
        return (
            f"graphgear: this tensor is an output of the reduce-overhead graph "
            f"{self.record.name} ({self.ctx.stage}), and a later replay of a graph in the same "
            f"memory pool has overwritten it. Clone outputs you keep before calling the "
            f"compiled model again (out.clone()), or set capture_config.clone_output=True."
        )

    def _hand_out(self, e: _Entry, outs: list[Any]) -> list[Any]:
        if self.clone_output:
            return [o.clone() if isinstance(o, torch.Tensor) else o for o in outs]
        from .liveness import alias

        res = list(outs)
        pool = self.pool
        for i, a in enumerate(e.alias_out):
            if a:
                t = alias(res[i])
                pool.hand_out(t)
                res[i] = t
        return res

    # ---- release ---------------------------------------------------------------------
    def release(self) -> None:
        """Drop every capture and free its memory; the next call warms up and captures
        again."""
        for e in self.entries.values():
            if e.graph is not None:
                e.graph.release()
                self.group.captures -= 1
        self.entries.clear()
        if self.private_pool or self.pool is self.group.pool:
            self.pool.release()
        else:
            self.pool.invalidate(self._stale_msg())
        self.group.captures = max(0, self.group.captures)
        self.group.limit_warned = False

"""Run-time dispatch of one AOT graph by graph key (:class:`GearedGraph`): one compiled
callable per key, built on first use; a key outside the gears raises before any work,
or with ``gear_padding`` runs the next gear up on zero-padded inputs and slices the
outputs back; :func:`precompile_gears` builds every gear up front."""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm import tqdm

from ._torch.aot import boxed_convention
from ._torch.dynamo import compile_session
from .errors import GearError
from .gears import GearPlan
from .padding import PaddingHazard
from .shapes import ShapeInfo, graph_outputs

log = logging.getLogger(__name__)

#: distinct values of a graph's Python int inputs (per shape) compiled before new ones
#: run uncompiled: an int that changes every call would otherwise compile every call
SCALAR_KEYS = 8

__all__ = ["SCALAR_KEYS", "GearedGraph", "UnsliceableDim", "output_specs", "precompile_gears", "unsliceable_outputs"]


# Set by precompile_gears around its one call of the compiled model, read by the
# GearedGraph that call reaches (dynamo and AOTAutograd sit between, with no way to pass
# an argument through); a context variable, so it holds for that call alone.
_PRECOMPILE: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "graphgear_precompile_gears", default=None)


def precompiling() -> dict[str, Any] | None:
    """The running ``precompile_gears`` call's state (its progress bar), else None."""
    return _PRECOMPILE.get()


@boxed_convention
class GearedGraph:
    """Run-time dispatch of one AOT graph by graph key. Boxed (AOTAutograd calls it with
    one list of inputs), and so is each key's callable (an engine, Inductor's compiled
    graph): a replay is one call deep below AOTAutograd.

    ``build(key)`` returns the compiled boxed callable of one key (a static graph in
    max-autotune and reduce-overhead). With a :class:`GearPlan`, a key outside the
    gears raises :class:`GearError` before any work, or with ``gear_padding`` runs the
    next gear up on zero-padded inputs and slices every output dim of that size back.
    """

    def __init__(
        self,
        info: ShapeInfo,
        plan: GearPlan | None,
        build: Callable[[tuple[int, ...]], Callable[..., Any]],
        *,
        padding: bool,
        out_specs: list[Any],
        mutated: Sequence[int],
        record: Any,
        calls_to_build: int = 1,
        unsliceable: Sequence[UnsliceableDim] = (),
        hazards: Sequence[PaddingHazard] = (),
        size_outputs: Sequence[tuple[int, Any]] = (),
        caller_outputs: int | None = None,
        tangents: Sequence[int] = (),
        value_only: tuple[Sequence[int], Sequence[tuple[int, Any]]] = ((), ()),
        scalars: Sequence[int] = (),
        uncompiled: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        self.info = info
        self.plan = plan
        self.build = build
        self.padding = padding
        self.out_specs = out_specs  # per output: {dim: symbol index} for dims of a geared symbol
        # a training forward: its first ``caller_outputs`` outputs go to the caller (sliced
        # when padded), the rest to its backward (kept at the gear's size)
        self.caller_outputs = len(out_specs) if caller_outputs is None else caller_outputs
        # output dims whose size is an expression of one (only the caller's are sliced)
        self.unsliceable = [u for u in unsliceable if u.output < self.caller_outputs]
        # nodes whose results padding changes (``padding.padding_hazards``): a padded call
        # that grows one of their symbols is refused
        self.hazards = list(hazards)
        # outputs that are Python ints of the sizes: a padded call returns them at the real sizes
        self.size_outputs = [(k, v) for k, v in size_outputs if k < self.caller_outputs]
        # a backward with gear padding: its tangents (see :meth:`_pad_tangents`)
        self.tangents = list(tangents)
        # symbols no tensor depends on (``shapes.value_only_symbols``): every call runs the
        # key of their first values, and the SymInt outputs of them are computed per call
        self.value_only = [(i, info.locs[i].arg) for i in value_only[0]]
        self.sym_outputs = list(value_only[1])
        self._first: dict[int, Any] = {}
        # symbols read from Python ints that reach tensor values (not shapes): each value
        # is a key of its own; past SCALAR_KEYS values per shape the graph runs as it is
        # (``uncompiled``) instead of compiling once more per value
        self.scalars = [i for i in scalars if i not in {i for i, _ in self.value_only}]
        self.uncompiled = uncompiled
        self._scalar_values: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
        self._storm_warned = False
        self.mutated = list(mutated)
        self.record = record
        self.compiled: dict[tuple[int, ...], Callable[..., Any]] = {}
        self.warmed: set[tuple[int, ...]] = set()
        self.calls_to_build = calls_to_build  # calls that compile (and capture) one key
        # padded copies of inputs, one per (thread, argument, gear): a stable address, so
        # a captured graph that binds or mutates it in place is not captured again, and
        # concurrent callers never share one
        self._pad_buffers: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}
        self.per_key = True  # each key is compiled by ``build`` (False: one shared graph)
        self._lock = threading.Lock()
        if plan is not None:
            record.gears = list(plan.combos)

    def _get(self, key: tuple[int, ...]) -> Callable[..., Any]:
        fn = self.compiled.get(key)
        if fn is None and self.scalars and self.uncompiled is not None and self._scalar_storm(key):
            return self.uncompiled
        if fn is None:
            # a run-time compile holds what dynamo holds around its own (see
            # ``compile_session``): other threads' calls wait instead of being refused
            with compile_session(), self._lock:
                fn = self.compiled.get(key)
                if fn is None:
                    fn = self.build(key)
                    self.compiled[key] = fn
        return fn

    def _scalar_storm(self, key: tuple[int, ...]) -> bool:
        """Whether ``key`` is one more value of the Python ints in :attr:`scalars` past
        :data:`SCALAR_KEYS` for its shapes (then it runs uncompiled, with one warning)."""
        scalars = set(self.scalars)
        shape = tuple(v for i, v in enumerate(key) if i not in scalars)
        value = tuple(key[i] for i in self.scalars)
        with self._lock:
            seen = self._scalar_values.setdefault(shape, set())
            if value in seen or len(seen) < SCALAR_KEYS:
                seen.add(value)
                return False
        if not self._storm_warned:
            self._storm_warned = True
            names = ", ".join(repr(self.info.placeholders[self.info.locs[i].arg].name) for i in self.scalars)
            reason = (f"Python int input(s) {names} took more than {SCALAR_KEYS} values, each a graph "
                      f"key of its own (a compile each); new values now run the graph uncompiled")
            self.record.add_fallback("graph key", reason)
            msg = (f"graphgear: {self.record.name}: {reason}. Pass such a number as a tensor "
                   f"(torch.tensor(n)) to compile once, or keep it constant.")
            warnings.warn(msg, UserWarning, stacklevel=2)
            log.warning(msg)
        return True

    def __call__(self, args: list[Any]) -> Any:
        if not self.value_only:
            return self._call(args)
        real = self.info.key(args)
        for i, j in self.value_only:  # the tensor work is the same for any value: one key
            args[j] = self._first.setdefault(i, args[j])
        return _with_sizes(self._call(args), self.sym_outputs, self.info.size_at(real))

    def _call(self, args: list[Any]) -> Any:
        key = self.info.key(args)
        if self.tangents:
            grow = self._pad_tangents(args, key)
            if grow:
                return self._slice_outputs(self._get(key)(args), grow)
        if self.plan is not None and precompiling() is not None:
            self.precompile(args)
        if self.plan is None or self.plan.allowed(key):
            return self._get(key)(args)
        target = self.plan.pad_target(key) if self.padding else None
        if target is None:
            raise self.plan.error(key, self.padding)
        return self._run_padded(args, key, target)

    def _run_padded(self, args: Sequence[Any], key: tuple[int, ...], target: tuple[int, ...]) -> Any:
        info = self.info
        grow = {i: (key[i], target[i]) for i in range(len(key)) if key[i] != target[i]}
        self._check_sliceable(key, target, grow)
        self._check_hazards(grow)
        padded: list[int] = []
        strides = info.size_at(target)

        def pad(j: int, a: torch.Tensor, shape: list[int]) -> torch.Tensor:
            k = (threading.get_ident(), j, target)
            p = self._pad_buffers.get(k)
            if p is None or list(p.shape) != shape or p.dtype != a.dtype or p.device != a.device:
                # the gear's strides: its code was compiled for them (a transposed input
                # padded into a contiguous buffer fails Inductor's stride assertion)
                v = info.vals[j]
                p = torch.empty_strided(shape, [strides(x) for x in v.stride()], dtype=a.dtype,
                                        device=a.device).zero_()
                self._pad_buffers[k] = p
            else:
                p.zero_()
            p[tuple(slice(0, n) for n in a.shape)] = a
            padded.append(j)
            return p

        new_args = _args_at(info, args, target, pad)
        out = self._get(target)(list(new_args))  # a boxed callee may clear its list
        for j in padded:
            if j in self.mutated:  # write the real rows back into the caller's tensor
                args[j].copy_(new_args[j][tuple(slice(0, n) for n in args[j].shape)])
        out = self._slice_outputs(out, grow)
        return _with_sizes(out, self.size_outputs, info.size_at(key)) if self.size_outputs else out

    def _padded_inputs(self, hit: list[int], grow: dict[int, tuple[int, int]],
                       symbols: bool = False) -> tuple[str, str]:
        """For a refused padded call: which inputs grew (naming each dim's symbol with
        ``symbols``), and their gears."""
        assert self.plan is not None
        where = self.plan.where
        padded = "; ".join(
            f"input {where[i][0]!r} dim {where[i][1]}"
            + (f" ({self.info.symbols[i]})" if symbols else "")
            + f" has size {grow[i][0]}, padded to gear {grow[i][1]}" for i in hit)
        gears = ", ".join(f"{where[i][0]!r} dim {where[i][1]}: {self.plan.sym_gears[i]}" for i in hit)
        return padded, gears

    def _check_hazards(self, grow: dict[int, tuple[int, int]]) -> None:
        """Refuse, before any work, a padded call whose graph reads across the padded
        rows or uses the padded size as a value (``padding.padding_hazards``)."""
        for h in self.hazards:
            hit = sorted(i for i in h.symbols if i in grow)
            if not hit:
                continue
            padded, gears = self._padded_inputs(hit, grow)
            raise GearError(
                f"graphgear: gear padding cannot run this call of {self.record.name}: {padded}, but "
                f"node {h.node} ({h.target}) {h.reason}, so the padded rows would change the "
                f"real results. Pass sizes that are gears ({gears}), or turn padding off "
                "(config.inference_config.gear_padding = False).")

    def _pad_tangents(self, args: list[Any], key: tuple[int, ...]) -> dict[int, tuple[int, int]]:
        """The backward of a forward that ran padded: its saved activations (read first:
        they give ``key``) have the gear's sizes, its tangents (the gradients of the
        caller's sliced outputs) the real ones. Each such tangent is zero-padded to the
        gear's size in ``args`` (the padded rows' gradients are zero, so they add nothing),
        and the returned ``{symbol: (real, gear)}`` says how to slice the gradients."""
        grow: dict[int, tuple[int, int]] = {}
        info = self.info
        for j in self.tangents:
            a = args[j]
            want = info.shape_at(j, key)
            if not isinstance(a, torch.Tensor) or want is None or list(a.shape) == want:
                continue
            for d, (have, gear) in enumerate(zip(a.shape, want)):
                if have == gear:
                    continue
                sym = info.symbol_at(j, d)
                i = info.symbols.index(sym) if sym is not None else None
                if i is None or have > gear or grow.get(i, (have, gear)) != (have, gear):
                    raise GearError(
                        f"graphgear: the backward of {self.record.name} got gradient input "
                        f"{info.placeholders[j].name} of size {tuple(a.shape)} where its forward "
                        f"ran at {tuple(want)}; a forward run with gear padding can be "
                        f"differentiated only through outputs whose padded dims are plain gear "
                        f"dims. Pass sizes that are gears, or turn padding off "
                        f"(config.inference_config.gear_padding = False).")
                grow[i] = (have, gear)
            ev = info.size_at(key)
            v = info.vals[j]
            p = torch.empty_strided(want, [ev(s) for s in v.stride()], dtype=a.dtype, device=a.device).zero_()
            p[tuple(slice(0, n) for n in a.shape)] = a
            args[j] = p
        return grow

    def _check_sliceable(
        self, key: tuple[int, ...], target: tuple[int, ...], grow: dict[int, tuple[int, int]]
    ) -> None:
        """Refuse, before any work, to pad a size that an output carries in an expression
        (``2*s`` from ``cat([x, x])``, ``3*s`` from ``reshape(-1)``): the padded rows sit
        inside the result, not at its end, so no slice gives the real values."""
        for u in self.unsliceable:
            hit = sorted(i for i in u.symbols if i in grow)
            if not hit:
                continue
            padded, gears = self._padded_inputs(hit, grow, symbols=True)
            raise GearError(
                f"graphgear: gear padding cannot run this call: {padded}, but output "
                f"{u.output} ({u.node}) has size {u.expr} at dim {u.dim}, an expression of "
                "the padded size, so the real values cannot be sliced out of the padded "
                f"result. Pass sizes that are gears ({gears}), or turn padding off "
                "(config.inference_config.gear_padding = False)."
            )

    def _slice_outputs(self, out: Any, grow: dict[int, tuple[int, int]]) -> Any:
        seq = list(out) if isinstance(out, list | tuple) else [out]
        for k, spec in enumerate(self.out_specs[: self.caller_outputs]):
            if k >= len(seq) or not isinstance(seq[k], torch.Tensor) or not spec:
                continue
            t = seq[k]
            for d, i in spec.items():
                if i in grow:
                    t = t.narrow(d, 0, grow[i][0])
            seq[k] = t
        if isinstance(out, tuple):
            return tuple(seq)
        if isinstance(out, list):
            return seq
        return seq[0]

    def precompile(self, args: Sequence[Any]) -> None:
        """Compile (and in reduce-overhead capture) every gear now, with inputs made from
        ``args`` by zero-padding or narrowing the geared dims; inputs the graph mutates are
        restored afterwards."""
        assert self.plan is not None
        progress = precompiling()
        keys = [k for k in self.plan.all_keys(self.info.key(args)) if k not in self.warmed]
        snapshot = {j: args[j].clone() for j in self.mutated if isinstance(args[j], torch.Tensor)}
        bar = progress.get("bar")
        progress["discard"] = True  # these calls' outputs are dropped (see CaptureEngine._warmup)
        try:
            for key in keys:
                fn = self._get(key)
                resized = _resize_args(self.info, args, key)
                with torch.no_grad():
                    for _ in range(self.calls_to_build):
                        fn(list(resized))
                self.warmed.add(key)
                if bar is not None:
                    bar.update(1)
        finally:
            progress["discard"] = False
        for j, saved in snapshot.items():
            args[j].copy_(saved)


def _with_sizes(out: Any, outputs: Sequence[tuple[int, Any]], ev: Callable[[Any], int]) -> Any:
    """``out`` with each output ``k`` of ``outputs`` (a SymInt of the graph's sizes) set
    to its value under ``ev`` (the real sizes)."""
    seq = list(out) if isinstance(out, list | tuple) else [out]
    for k, v in outputs:
        seq[k] = ev(v)
    return type(out)(seq) if isinstance(out, list | tuple) else seq[0]


def _args_at(info: ShapeInfo, args: Sequence[Any], key: Sequence[int],
             resize: Callable[[int, torch.Tensor, list[int]], torch.Tensor]) -> list[Any]:
    """``args`` at graph key ``key``: every symbolic size set to its value there, and
    ``resize(j, tensor, shape)`` for each tensor whose shape differs at ``key``."""
    size = info.size_at(key)
    out = list(args)
    for j, v in enumerate(info.vals):
        a = args[j]
        if isinstance(v, torch.SymInt):
            out[j] = size(v)
        elif isinstance(v, torch.Tensor) and isinstance(a, torch.Tensor):
            shape = info.shape_at(j, key)
            if shape != list(a.shape):
                out[j] = resize(j, a, shape)
    return out


def _resize_args(info: ShapeInfo, args: Sequence[Any], key: Sequence[int]) -> list[Any]:
    """``args`` with every symbolic size set to ``key`` (zero-padded or narrowed)."""

    def resize(j: int, a: torch.Tensor, shape: list[int]) -> torch.Tensor:
        t = a.new_zeros(shape)
        common = tuple(slice(0, min(x, y)) for x, y in zip(shape, a.shape))
        t[common] = a[common]
        return t

    return _args_at(info, args, key, resize)


def output_specs(gm: Any, info: ShapeInfo) -> list[dict[int, int]]:
    """For each graph output, which dims carry which symbol (index into info.symbols)."""
    specs: list[dict[int, int]] = []
    for o in graph_outputs(gm):
        v = o.meta.get("val") if hasattr(o, "meta") else None
        spec: dict[int, int] = {}
        if isinstance(v, torch.Tensor):
            for d, s in enumerate(v.shape):
                if isinstance(s, torch.SymInt) and s.node.expr in info.symbols:
                    spec[d] = info.symbols.index(s.node.expr)
        specs.append(spec)
    return specs


@dataclasses.dataclass(frozen=True)
class UnsliceableDim:
    """An output dim whose size is an expression of graph-key symbols other than one
    symbol itself (``2*s0``, ``3*s0``, ``s0 + 1``): padding those symbols cannot be
    undone by slicing."""

    output: int  # index among the graph's outputs
    node: str  # the output node's name
    dim: int
    expr: str
    symbols: frozenset[int]  # indices into ShapeInfo.symbols


def unsliceable_outputs(gm: Any, info: ShapeInfo) -> list[UnsliceableDim]:
    """Every output dim whose size depends on a graph-key symbol without being it."""
    outs = graph_outputs(gm)
    index = {s: i for i, s in enumerate(info.symbols)}
    found: list[UnsliceableDim] = []
    for k, o in enumerate(outs):
        v = o.meta.get("val") if hasattr(o, "meta") else None
        if not isinstance(v, torch.Tensor):
            continue
        for d, s in enumerate(v.shape):
            if not isinstance(s, torch.SymInt) or s.node.expr in index:
                continue
            syms = frozenset(index[f] for f in s.node.expr.free_symbols if f in index)
            if syms:
                found.append(UnsliceableDim(k, o.name, d, str(s.node.expr), syms))
    return found


def precompile_gears(fn: Callable[..., Any], *args: Any, progress: bool = False, **kwargs: Any) -> Any:
    """Compile (and capture) every gear of every graph a call touches, before serving.

    ``graphgear.inference.precompile_gears(compiled_model, *args, **kwargs)`` calls the
    compiled model once with ``args``; each geared graph then builds all its gears on
    inputs derived from ``args`` (inputs it mutates, such as KV caches, are restored).
    Returns the call's output. ``progress=True`` shows a progress bar (tqdm).
    """
    bar = tqdm(desc="graphgear: building gears", unit="gear", leave=False) if progress else None
    token = _PRECOMPILE.set({"bar": bar})
    try:
        return fn(*args, **kwargs)
    finally:
        _PRECOMPILE.reset(token)
        if bar is not None:
            bar.close()

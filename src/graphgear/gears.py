"""Gears: a fixed set of sizes for a dynamic dim, one specialised graph per gear."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .errors import GearError
from .shapes import ShapeInfo
from .stats import on_reset

log = logging.getLogger(__name__)

__all__ = ["get_dim_gears", "set_dim_gears"]

_ATTR = "_graphgear_dim_gears"
MAX_GEARS = 100


def get_dim_gears(t: Any) -> dict[int, list[int]]:
    """Gears recorded on ``t`` (empty when none)."""
    return dict(getattr(t, _ATTR, None) or {})


def set_dim_gears(t: torch.Tensor, dim_gears: dict[int, list[int] | tuple[int, ...]]) -> None:
    """Limit dims of ``t`` to a fixed set of sizes; call before the first compiled call.

    Marks each listed dim dynamic; every other dim of ``t`` stays static. The gears are
    recorded on the tensor, so they hold through every recompile.
    """
    if not isinstance(t, torch.Tensor):
        raise GearError(f"graphgear.set_dim_gears: expected a torch.Tensor, got {type(t).__name__}.")
    if not isinstance(dim_gears, dict) or not dim_gears:
        raise GearError(
            f"graphgear.set_dim_gears: dim_gears must be a non-empty dict {{dim: [sizes]}}, "
            f"got {dim_gears!r}."
        )
    clean: dict[int, list[int]] = {}
    for dim, gears in dim_gears.items():
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise GearError(f"graphgear.set_dim_gears: dim must be an int, got {dim!r}.")
        if not -t.dim() <= dim < t.dim():
            raise GearError(
                f"graphgear.set_dim_gears: dim {dim} is out of range for a tensor of "
                f"{t.dim()} dims (shape {tuple(t.shape)}); allowed: {-t.dim()}..{t.dim() - 1}."
            )
        dim = dim % t.dim()
        if not isinstance(gears, list | tuple) or not all(
            isinstance(g, int) and not isinstance(g, bool) and g > 0 for g in gears
        ):
            raise GearError(
                f"graphgear.set_dim_gears: gears of dim {dim} must be a list or tuple of "
                f"positive ints, got {gears!r}."
            )
        sizes = sorted(set(gears))
        if not 2 <= len(sizes) <= MAX_GEARS:
            raise GearError(
                f"graphgear.set_dim_gears: dim {dim} needs 2 to {MAX_GEARS} distinct sizes, "
                f"got {len(sizes)} ({sizes}). For one size, leave the dim static."
            )
        clean[dim] = sizes
    old = get_dim_gears(t)
    for dim, sizes in clean.items():
        if dim in old and old[dim] != sizes:
            raise GearError(
                f"graphgear.set_dim_gears: dim {dim} of this tensor already has gears "
                f"{old[dim]}; it cannot be given {sizes}. Gears are fixed once set: use a "
                f"new tensor for other gears."
            )
    old.update(clean)
    setattr(t, _ATTR, old)
    if not isinstance(t, torch._subclasses.FakeTensor):
        for dim, sizes in clean.items():
            _set_oblivious_if_needed(sizes)
            torch._dynamo.mark_dynamic(t, dim)


def guard_gears_shape(example_inputs: Any, names: Sequence[str] = ()) -> None:
    """Check that every concrete size of a geared dim is one of its gears (a dim that
    dynamo specialised to one size)."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            continue
        for dim, gears in get_dim_gears(x).items():
            size = x.shape[dim]
            if is_concrete_int(size) and int(size) not in gears:
                name = repr(names[i]) if i < len(names) else str(i)
                raise GearError(
                    f"graphgear: input {name} has size {int(size)} at dim {dim}, which is not "
                    f"one of its gears {gears}; pass a size in the gears (dynamo specialised "
                    "this dim, so padding cannot apply)."
                )


def restore_global_settings() -> None:
    """Undo the process-wide setting a gear of 1 turned on (called by ``reset()``)."""
    if _oblivious_before:
        torch.fx.experimental._config.backed_size_oblivious = _oblivious_before[0]
        _oblivious_before.clear()


# --------------------------------------------------------------------------- plan


_oblivious_before: list[bool] = []


def _set_oblivious_if_needed(sizes: list[int]) -> None:
    """Size 1 must not be 0/1-specialised by dynamo, whether it is a gear or padded up
    to one (that would trace a second graph): turn on size-oblivious reasoning for
    backed sizes, process-wide, until ``graphgear.reset()`` restores the previous
    setting."""
    if sizes:
        cfg = torch.fx.experimental._config
        if hasattr(cfg, "backed_size_oblivious") and not cfg.backed_size_oblivious:
            _oblivious_before.append(False)
            on_reset(restore_global_settings)
            log.info(
                "graphgear: size 1 is a gear (or pads up to one); enabling "
                "torch.fx.experimental._config.backed_size_oblivious so size 1 shares the "
                "dynamic graph instead of being specialised"
            )
            cfg.backed_size_oblivious = True


class GearPlan:
    """The allowed graph keys of one AOT graph, from its inputs' gears.

    ``geared`` lists, per symbol of the graph key, the gears of that symbol (``None``
    for a symbol without gears, e.g. under ``dynamic=True``). ``keys`` is the set of
    allowed combinations of the geared symbols after the merge policy.
    """

    def __init__(
        self,
        info: ShapeInfo,
        sym_gears: dict[int, list[int]],
        where: dict[int, tuple[str, int]],
        policy: str,
    ) -> None:
        self.info = info
        self.sym_gears = sym_gears  # symbol index -> gears
        self.where = where  # symbol index -> (input name, dim) for messages
        self.policy = policy
        self.order = sorted(sym_gears)
        lists = [sym_gears[i] for i in self.order]
        if policy == "zip":
            lengths = {len(g) for g in lists}
            if len(lengths) > 1:
                desc = ", ".join(
                    f"{self.where[i][0]} dim {self.where[i][1]}: {sym_gears[i]}" for i in self.order
                )
                raise GearError(
                    "graphgear: dynamic_gears_merge_policy='zip' needs gear lists of equal "
                    f"length, got {desc}. Give every geared dim the same number of sizes, or "
                    "set config.inference_config.dynamic_gears_merge_policy = 'product'."
                )
            combos = list(zip(*lists))
        else:
            combos = list(itertools.product(*lists))
        combos = list(dict.fromkeys(combos))
        if len(combos) > MAX_GEARS:
            raise GearError(
                f"graphgear: the gears combine into {len(combos)} graphs under "
                f"dynamic_gears_merge_policy={policy!r}; at most {MAX_GEARS} are allowed. "
                "Use fewer sizes per dim, or 'zip' instead of 'product'."
            )
        self.combos = combos
        self._allowed = set(combos)

    @classmethod
    def build(
        cls, info: ShapeInfo, example_inputs: Sequence[Any], names: Sequence[str], policy: str
    ) -> GearPlan | None:
        sym_gears: dict[int, list[int]] = {}
        where: dict[int, tuple[str, int]] = {}
        for i, x in enumerate(example_inputs):
            for dim, gears in get_dim_gears(x).items():
                sym = info.symbol_at(i, dim)
                if sym is None:
                    continue  # the dim was specialised: a static graph, the guard checks it
                j = info.symbols.index(sym)
                if j in sym_gears and sym_gears[j] != gears:
                    sym_gears[j] = sorted(set(sym_gears[j]) & set(gears))
                else:
                    sym_gears[j] = list(gears)
                where.setdefault(j, (names[i] if i < len(names) else f"input {i}", dim))
        if not sym_gears:
            return None
        return cls(info, sym_gears, where, policy)

    def project(self, key: Sequence[int]) -> tuple[int, ...]:
        return tuple(key[i] for i in self.order)

    def allowed(self, key: Sequence[int]) -> bool:
        return self.project(key) in self._allowed

    def all_keys(self, template: Sequence[int]) -> list[tuple[int, ...]]:
        """Every allowed full key; non-geared symbols keep their value in ``template``."""
        out = []
        for combo in self.combos:
            k = list(template)
            for i, v in zip(self.order, combo):
                k[i] = v
            out.append(tuple(k))
        return out

    def pad_target(self, key: Sequence[int]) -> tuple[int, ...] | None:
        """The smallest allowed key at or above ``key`` in every geared symbol."""
        want = self.project(key)
        best: tuple[int, ...] | None = None
        for combo in self.combos:
            if all(c >= w for c, w in zip(combo, want)) and (best is None or sum(combo) < sum(best)):
                best = combo
        if best is None:
            return None
        k = list(key)
        for i, v in zip(self.order, best):
            k[i] = v
        return tuple(k)

    def error(self, key: Sequence[int], padding: bool) -> GearError:
        bad = [i for i in self.order if key[i] not in self.sym_gears[i]] or self.order
        parts = []
        for i in bad:
            name, dim = self.where[i]
            parts.append(
                f"input {name!r} has size {key[i]} at dim {dim}, which is not one of its gears "
                f"{self.sym_gears[i]}"
            )
        hint = (
            "the size is above the largest gear, so padding cannot help"
            if padding
            else "pass a size in the gears, or set config.inference_config.gear_padding = True "
            "to pad up to the next gear"
        )
        if len(self.order) > 1 and all(key[i] in self.sym_gears[i] for i in self.order):
            combo = dict(zip([self.where[i] for i in self.order], self.project(key)))
            return GearError(
                f"graphgear: the sizes {combo} are each a gear, but not a combination allowed "
                f"by dynamic_gears_merge_policy={self.policy!r} ({self.combos}); {hint}."
            )
        return GearError("graphgear: " + "; ".join(parts) + f"; {hint}.")


_precompile = threading.local()


def precompiling() -> Any:
    return getattr(_precompile, "progress", None)


class GearedGraph:
    """Run-time dispatch of one AOT graph by graph key.

    ``build(key)`` returns the compiled callable of one key (a static graph in
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
    ) -> None:
        self.info = info
        self.plan = plan
        self.build = build
        self.padding = padding
        self.out_specs = out_specs  # per output: {dim: symbol index} for dims of a geared symbol
        self.unsliceable = list(unsliceable)  # output dims whose size is an expression of one
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
        if fn is None:
            with self._lock:
                fn = self.compiled.get(key)
                if fn is None:
                    fn = self.build(key)
                    self.compiled[key] = fn
        return fn

    def __call__(self, *args: Any) -> Any:
        key = self.info.key(args)
        if self.plan is not None and precompiling() is not None:
            self.precompile(args)
        if self.plan is None or self.plan.allowed(key):
            return self._get(key)(*args)
        target = self.plan.pad_target(key) if self.padding else None
        if target is None:
            raise self.plan.error(key, self.padding)
        return self._run_padded(args, key, target)

    def _run_padded(self, args: Sequence[Any], key: tuple[int, ...], target: tuple[int, ...]) -> Any:
        info = self.info
        grow = {i: (key[i], target[i]) for i in range(len(key)) if key[i] != target[i]}
        self._check_sliceable(key, target, grow)
        size = info.size_at(target)
        new_args = list(args)
        padded: list[int] = []
        for j, v in enumerate(info.vals):
            a = args[j]
            if isinstance(v, torch.SymInt):
                new_args[j] = size(v)
            elif isinstance(v, torch.Tensor) and isinstance(a, torch.Tensor):
                shape = info.shape_at(j, target)
                if shape == list(a.shape):
                    continue
                k = (threading.get_ident(), j, target)
                p = self._pad_buffers.get(k)
                if p is None or list(p.shape) != shape or p.dtype != a.dtype or p.device != a.device:
                    p = a.new_zeros(shape)
                    self._pad_buffers[k] = p
                else:
                    p.zero_()
                p[tuple(slice(0, n) for n in a.shape)] = a
                new_args[j] = p
                padded.append(j)
        out = self._get(target)(*new_args)
        for j in padded:
            if j in self.mutated:  # write the real rows back into the caller's tensor
                args[j].copy_(new_args[j][tuple(slice(0, n) for n in args[j].shape)])
        return self._slice_outputs(out, grow)

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
            assert self.plan is not None
            padded = "; ".join(
                f"input {self.plan.where[i][0]!r} dim {self.plan.where[i][1]} "
                f"({self.info.symbols[i]}) has size {grow[i][0]}, padded to gear {grow[i][1]}"
                for i in hit
            )
            gears = ", ".join(
                f"{self.plan.where[i][0]!r} dim {self.plan.where[i][1]}: {self.plan.sym_gears[i]}"
                for i in hit
            )
            raise GearError(
                f"graphgear: gear padding cannot run this call: {padded}, but output "
                f"{u.output} ({u.node}) has size {u.expr} at dim {u.dim}, an expression of "
                "the padded size, so the real values cannot be sliced out of the padded "
                f"result. Pass sizes that are gears ({gears}), or turn padding off "
                "(config.inference_config.gear_padding = False)."
            )

    def _slice_outputs(self, out: Any, grow: dict[int, tuple[int, int]]) -> Any:
        seq = list(out) if isinstance(out, list | tuple) else [out]
        for k, spec in enumerate(self.out_specs):
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
        for key in keys:
            fn = self._get(key)
            resized = _resize_args(self.info, args, key)
            with torch.no_grad():
                for _ in range(self.calls_to_build):
                    fn(*resized)
            self.warmed.add(key)
            if bar is not None:
                bar.update(1)
        for j, saved in snapshot.items():
            args[j].copy_(saved)


def _resize_args(info: ShapeInfo, args: Sequence[Any], key: Sequence[int]) -> list[Any]:
    """``args`` with every symbolic size set to ``key`` (zero-padded or narrowed)."""
    size = info.size_at(key)
    out = list(args)
    for j, v in enumerate(info.vals):
        a = args[j]
        if isinstance(v, torch.SymInt):
            out[j] = size(v)
        elif isinstance(v, torch.Tensor) and isinstance(a, torch.Tensor):
            shape = info.shape_at(j, key)
            if shape == list(a.shape):
                continue
            t = a.new_zeros(shape)
            common = tuple(slice(0, min(x, y)) for x, y in zip(shape, a.shape))
            t[common] = a[common]
            out[j] = t
    return out


def output_specs(gm: Any, info: ShapeInfo) -> list[dict[int, int]]:
    """For each graph output, which dims carry which symbol (index into info.symbols)."""
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    outs = out_node.args[0]
    outs = outs if isinstance(outs, list | tuple) else [outs]
    specs: list[dict[int, int]] = []
    for o in outs:
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
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    outs = out_node.args[0]
    outs = outs if isinstance(outs, list | tuple) else [outs]
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


class precompile_gears:  # noqa: N801 - used like a function
    """Compile (and capture) every gear of every graph a call touches, before serving.

    ``graphgear.inference.precompile_gears(compiled_model, *args, **kwargs)`` calls the
    compiled model once with ``args``; each geared graph then builds all its gears on
    inputs derived from ``args`` (inputs it mutates, such as KV caches, are restored).
    Returns the call's output.
    """

    def __new__(cls, fn: Callable[..., Any], *args: Any, progress: bool = False, **kwargs: Any) -> Any:
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(desc="graphgear: building gears", unit="gear", leave=False)
        _precompile.progress = {"bar": bar}
        try:
            return fn(*args, **kwargs)
        finally:
            _precompile.progress = None
            if bar is not None:
                bar.close()

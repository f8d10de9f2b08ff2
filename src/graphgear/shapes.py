"""Symbolic sizes of an AOT graph: the graph key, and specialisation to one key.

A graph traced with dynamic dims has free symbols (``s0``, ``s1``...). At run time each
symbol has a concrete value, read off the arguments: the *graph key* is the tuple of
those values. :func:`specialize` re-traces the graph at one key into a graph with only
static shapes (``make_fx`` under a fresh fake mode: 0.02 to 0.04 s): what the modes
compile for a size ``inference_config.compile_sizes`` names (every other size takes the
graph's one compile with dynamic sizes, see ``pipeline``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv, guarding_hint_or_throw, statically_known_true

from ._torch.fx import FakeTensor, FakeTensorMode, fake_values, min_args, tracing, unset_fake_temporarily
from ._torch.ops import HigherOrderOperator

__all__ = ["ShapeInfo", "graph_outputs", "padded_dims", "scalar_symbols", "size_outputs", "specialize", "sym_dims",
           "symbol_dims", "value_only_symbols", "with_sizes"]


def sym_dims(v: Any) -> list[tuple[int, Any]]:
    """``(dim, size expression)`` for each dim of ``v`` (an FX value: a node's
    ``meta["val"]``) whose size is symbolic; empty where ``v`` is no tensor."""
    if not isinstance(v, torch.Tensor):
        return []
    return [(d, s.node.expr) for d, s in enumerate(v.shape) if isinstance(s, torch.SymInt)]


def symbol_dims(v: Any, index: dict[Any, int]) -> dict[int, int]:
    """``{dim: index[symbol]}`` for each dim of ``v`` whose size is one of the symbols of
    ``index`` itself (not an expression of it)."""
    return {d: index[e] for d, e in sym_dims(v) if e in index}


def padded_dims(v: Any, index: dict[Any, int]) -> dict[int, int]:
    """``{dim: index[s]}`` for each dim of ``v`` whose size is a geared symbol ``s``, or
    ``Min(n, s)`` for an int ``n`` (a slice ``t[:s]`` of a dim of fixed size ``n``: its
    rows are ``s``'s rows as long as ``s`` fits)."""
    out: dict[int, int] = {}
    for d, e in sym_dims(v):
        if e in index:
            out[d] = index[e]
        elif (args := min_args(e)) is not None and len(args) == 2:
            num, sym = sorted(args, key=lambda a: not a.is_Integer)
            if num.is_Integer and sym in index:
                out[d] = index[sym]
    return out


@dataclasses.dataclass(frozen=True)
class _Loc:
    arg: int
    dim: int | None  # None: the argument is itself the int


class ShapeInfo:
    """Where each free symbol of ``gm`` can be read from the run-time arguments."""

    def __init__(self, gm: fx.GraphModule, pinned_args: Sequence[int] = ()) -> None:
        """``pinned_args``: Python-int placeholders whose symbols the key holds at their
        example value, whatever the call passes (piecewise capture's split ints: only
        uncaptured split nodes read them, at their value of the call)."""
        self.placeholders = list(gm.graph.find_nodes(op="placeholder"))
        self.vals = [p.meta.get("val") for p in self.placeholders]
        self.symbols: list[sympy.Symbol] = []
        self.locs: list[_Loc] = []
        seen: set[sympy.Symbol] = set()
        for i, v in enumerate(self.vals):
            if isinstance(v, torch.SymInt):
                self._note(v.node.expr, _Loc(i, None), seen)
            else:
                for d, e in sym_dims(v):
                    self._note(e, _Loc(i, d), seen)
        self.pinned = {i: int(guarding_hint_or_throw(self.vals[loc.arg])) for i, loc in enumerate(self.locs)
                       if loc.dim is None and loc.arg in set(pinned_args)}
        # Symbols that only occur inside expressions (s0*s1) cannot be read directly.
        self.unreadable = sorted(
            {str(s) for v in self.vals for s in _free_symbols(v)} - {str(s) for s in seen}
        )

    def _note(self, expr: Any, loc: _Loc, seen: set[sympy.Symbol]) -> None:
        if isinstance(expr, sympy.Symbol) and expr not in seen:
            seen.add(expr)
            self.symbols.append(expr)
            self.locs.append(loc)

    @property
    def is_dynamic(self) -> bool:
        return bool(self.symbols)

    def key(self, args: Sequence[Any]) -> tuple[int, ...]:
        """The concrete value of every symbol, read from ``args`` (a pinned one: its
        example value)."""
        key = tuple(
            int(args[loc.arg]) if loc.dim is None else args[loc.arg].shape[loc.dim] for loc in self.locs
        )
        if self.pinned:
            return tuple(self.pinned.get(i, v) for i, v in enumerate(key))
        return key

    def symbol_at(self, arg: int, dim: int) -> sympy.Symbol | None:
        """The symbol of ``args[arg].shape[dim]`` if that dim is a plain symbol."""
        v = self.vals[arg] if arg < len(self.vals) else None
        if isinstance(v, torch.Tensor) and dim < v.dim() and isinstance(v.shape[dim], torch.SymInt):
            expr = v.shape[dim].node.expr
            if isinstance(expr, sympy.Symbol):
                return expr
        return None

    def size_at(self, key: Sequence[int]) -> Callable[[Any], int]:
        """A function giving the concrete value, at ``key``, of a size, stride or SymInt
        of this graph's placeholders."""
        bind = dict(zip(self.symbols, key))

        def ev(x: Any) -> int:
            if isinstance(x, torch.SymInt):
                return int(x.node.expr.xreplace(bind))
            return int(x)

        return ev

    def shape_at(self, arg: int, key: Sequence[int]) -> list[int] | None:
        """The concrete shape of placeholder ``arg`` at ``key`` (None if not a tensor)."""
        v = self.vals[arg]
        if not isinstance(v, torch.Tensor):
            return None
        ev = self.size_at(key)
        return [ev(s) for s in v.shape]

    def args_at(self, args: Sequence[Any], key: Sequence[int],
                resize: Callable[[int, torch.Tensor, list[int]], torch.Tensor]) -> list[Any]:
        """``args`` at graph key ``key``: every symbolic size set to its value there, and
        ``resize(j, tensor, shape)`` for each tensor whose shape differs at ``key``."""
        size = self.size_at(key)
        out = list(args)
        for j, v in enumerate(self.vals):
            a = args[j]
            if isinstance(v, torch.SymInt):
                out[j] = size(v)
            elif isinstance(v, torch.Tensor) and isinstance(a, torch.Tensor):
                shape = self.shape_at(j, key)
                if shape != list(a.shape):
                    out[j] = resize(j, a, shape)
        return out

    def resized_args(self, args: Sequence[Any], key: Sequence[int]) -> list[Any]:
        """``args`` with every symbolic size set to ``key`` (zero-padded or narrowed)."""

        def resize(j: int, a: torch.Tensor, shape: list[int]) -> torch.Tensor:
            t = a.new_zeros(shape)
            common = tuple(slice(0, min(x, y)) for x, y in zip(shape, a.shape))
            t[common] = a[common]
            return t

        return self.args_at(args, key, resize)

    def concrete(self, key: Sequence[int]) -> list[Any]:
        """Example arguments (fake tensors in a new fake mode, or ints) at ``key``."""
        ev = self.size_at(key)

        # a shape env (with nothing symbolic in it) lets Inductor use its FX graph cache
        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
        out: list[Any] = []
        with mode:
            for v in self.vals:
                if isinstance(v, torch.Tensor):
                    t = torch.empty_strided(
                        [ev(s) for s in v.shape], [ev(s) for s in v.stride()], dtype=v.dtype, device=v.device
                    )
                    if v.requires_grad:
                        t.requires_grad_(True)
                    out.append(t)
                elif isinstance(v, torch.SymInt | int):
                    out.append(ev(v))
                else:
                    out.append(v)
        return out


def _free_symbols(v: Any) -> set[Any]:
    if isinstance(v, torch.SymInt):
        return set(v.node.expr.free_symbols)
    if isinstance(v, torch.Tensor):
        out: set[Any] = set()
        for s in (*v.shape, *v.stride()):
            if isinstance(s, torch.SymInt):
                out |= set(s.node.expr.free_symbols)
        return out
    return set()


def scalar_symbols(info: ShapeInfo) -> list[int]:
    """Indices (into ``info.symbols``) of the symbols of Python int inputs (SymInt
    placeholders) that no tensor input's size or stride carries: numbers, not shapes."""
    shaped: set[Any] = set()
    for v in info.vals:
        if isinstance(v, torch.Tensor):
            shaped |= _free_symbols(v)
    return [i for i, loc in enumerate(info.locs) if loc.dim is None and info.symbols[i] not in shaped]


def value_only_symbols(gm: fx.GraphModule, info: ShapeInfo) -> tuple[list[int], list[tuple[int, Any]]]:
    """Symbols read from a SymInt input that no tensor of ``gm`` depends on: in no tensor's
    size or stride and in no argument of an op that makes a tensor (a Python int kept on
    a module and advanced by the graph: a sliding-window cache's ``cumulative_length_int``,
    which the graph only returns plus one). The tensor work is the same whatever their
    values, so one specialisation serves them all; only the graph's SymInt outputs of
    them differ. Returns their indices into ``info.symbols`` and, per such output, its
    index among the graph's outputs and its traced value (a SymInt)."""
    scalar = {info.symbols[i] for i in scalar_symbols(info)}
    if not scalar:
        return [], []
    free = set(scalar)
    for node in gm.graph.nodes:
        v = node.meta.get("val")
        if node.op == "output" or isinstance(v, torch.SymInt | torch.SymBool | torch.SymFloat | int | float | bool):
            continue  # scalar arithmetic, and what the graph returns
        free -= _free_symbols(v)
        if isinstance(v, list | tuple):
            for x in v:
                free -= _free_symbols(x)
        for a in node.all_input_nodes:
            free -= _free_symbols(a.meta.get("val"))
            if isinstance(a.meta.get("val"), torch.SymBool | torch.SymFloat):
                free -= set(a.meta["val"].node.expr.free_symbols)
        if not free:
            return [], []
    sym_outs = [(k, v) for k, v in size_outputs(gm) if free & _free_symbols(v)]
    return sorted(i for i, sym in enumerate(info.symbols) if sym in free), sym_outs


def graph_outputs(gm: fx.GraphModule) -> list[Any]:
    """The arguments of ``gm``'s output node, as a list."""
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    outs = out_node.args[0]
    return list(outs) if isinstance(outs, list | tuple) else [outs]


def size_outputs(gm: fx.GraphModule) -> list[tuple[int, Any]]:
    """``(output index, SymInt)`` for each output of ``gm`` that is a Python int of its
    sizes: the dispatcher computes it at the real sizes where the graph ran at others
    (a value-only symbol's first value, a padded gear)."""
    return [(k, o.meta["val"]) for k, o in enumerate(graph_outputs(gm))
            if isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.SymInt)
            and o.meta["val"].node.expr.free_symbols]


def with_sizes(out: Any, outputs: Sequence[tuple[int, Any]], ev: Callable[[Any], int]) -> Any:
    """``out`` with each output ``k`` of ``outputs`` (a SymInt of the graph's sizes) set
    to its value under ``ev`` (the real sizes)."""
    seq = list(out) if isinstance(out, list | tuple) else [out]
    for k, v in outputs:
        seq[k] = ev(v)
    return type(out)(seq) if isinstance(out, list | tuple) else seq[0]


def specialize(gm: fx.GraphModule, info: ShapeInfo, key: Sequence[int]) -> tuple[fx.GraphModule, list[Any]]:
    """``gm`` re-traced with every symbol fixed to ``key``: a static-shape aten graph and
    fake example inputs for it."""
    with unset_fake_temporarily(), tracing(None):
        args = info.concrete(key)
        mode = next((a.fake_mode for a in args if isinstance(a, FakeTensor)), None)
        ctx = mode if mode is not None else FakeTensorMode()
        with ctx:
            static = make_fx(_Runner(gm), tracing_mode="real", record_module_stack=False)(*args)
        if any(isinstance(n.target, HigherOrderOperator) and "val" not in n.meta for n in static.graph.nodes):
            # a higher-order op re-traced (a repeated region's shared subgraph call) is
            # left without a value; Inductor needs every node's
            fake_values(static, args)
    return static, args


class _Runner(torch.nn.Module):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__()
        self.gm = gm

    def forward(self, *args: Any) -> Any:
        return fx.Interpreter(self.gm).run(*args)


def known_equal(a: Any, b: Any) -> bool:
    """``a == b`` for sizes, shapes or strides, true only when it holds for every value
    of the symbols. Never adds a guard: passes must not specialise a dynamic graph."""
    if isinstance(a, tuple | list | torch.Size) or isinstance(b, tuple | list | torch.Size):
        if len(a) != len(b):
            return False
        return all(known_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return bool(statically_known_true(a == b))
    return a == b

"""A padded graph's outputs: which dims carry a graph-key symbol ``s`` or ``Min(n, s)``
(a slice ``t[:s]`` of a dim of fixed size ``n``), sliced back to the real size, and which
carry another expression of one (cannot be sliced: refused)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ..shapes import ShapeInfo, graph_outputs, padded_dims, sym_dims

__all__ = ["UnsliceableDim", "output_specs", "slice_outputs", "unsliceable_outputs"]


def _out_val(o: Any) -> Any:
    return o.meta.get("val") if hasattr(o, "meta") else None


def output_specs(gm: Any, info: ShapeInfo) -> list[dict[int, int]]:
    """For each graph output, which dims carry which symbol (index into info.symbols),
    as the symbol itself or ``Min(n, symbol)``."""
    index = {s: i for i, s in enumerate(info.symbols)}
    return [padded_dims(_out_val(o), index) for o in graph_outputs(gm)]


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
    index = {s: i for i, s in enumerate(info.symbols)}
    found: list[UnsliceableDim] = []
    for k, o in enumerate(graph_outputs(gm)):
        sliceable = padded_dims(_out_val(o), index)
        for d, expr in sym_dims(_out_val(o)):
            if d in sliceable:
                continue
            syms = frozenset(index[f] for f in expr.free_symbols if f in index)
            if syms:
                found.append(UnsliceableDim(k, o.name, d, str(expr), syms))
    return found


def slice_outputs(out: Any, specs: Sequence[dict[int, int]], grow: dict[int, tuple[int, int]]) -> Any:
    """``out`` (one output or a list or tuple of them) with each dim of ``specs`` (per
    output, ``{dim: symbol}``) whose symbol grew (``{symbol: (real, gear)}``) narrowed
    back to the real size (a ``Min(n, s)`` dim holds at most ``n`` rows at either size)."""
    seq = list(out) if isinstance(out, list | tuple) else [out]
    for k, spec in enumerate(specs):
        if k >= len(seq) or not isinstance(seq[k], torch.Tensor) or not spec:
            continue
        t = seq[k]
        for d, i in spec.items():
            if i in grow:
                t = t.narrow(d, 0, min(grow[i][0], t.shape[d]))
        seq[k] = t
    if isinstance(out, tuple):
        return tuple(seq)
    if isinstance(out, list):
        return seq
    return seq[0]

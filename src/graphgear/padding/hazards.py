"""Where gear padding would change real results: a static check of the AOT graph.

``gear_padding`` runs a size between gears at the next gear up on zero-padded inputs and
slices the outputs back. That is exact only when each real row of the result depends on
real rows alone. :func:`padding_hazards` finds, once per graph, the nodes that break
this for a padded dim (a dim whose size is a geared symbol ``s``); a padded call whose
grown symbols meet one raises :class:`~graphgear.errors.GearError` before any work
(:class:`graphgear.padding.PaddedCall`) instead of returning wrong values:

* **the size's value**: ``s`` used as a number rather than a shape (``x * x.shape[0]``,
  ``torch.tensor(n)``, ``full(..., s)``), or an index counted from the end of a padded
  dim (``h[:, -1]``, ``x[:-1]``, ``s - 1``): at the gear these see the gear's size.
  (Python ints the graph returns, ``x.shape[0] * 2``, are not hazards: the dispatcher
  computes them at the real size, ``shapes.size_outputs``.)
* **mixing along the padded dim**: a reduction (``sum``, ``mean``, ``amax``, ``var``,
  norms, ``argmax``...) whose output lost the dim, a matrix product contracting over it,
  ``softmax`` / ``log_softmax``, ``flip``, ``roll``, ``sort``, ``topk`` along it, a layer
  or group norm over it, batch norm in training over it, attention over padded keys
  with neither a mask nor ``is_causal``.

Masked attention is accepted: a softmax over a padded key dim of a score matrix whose
query dim is the same symbol, computed from a boolean mask (a causal mask from position
comparisons, or a padding mask: zero-padded, it masks the padded keys), and the
products of its result. What the mask says is the model's business: a mask that lets
real queries see the padded keys still gives wrong values.

A slice of a dim of fixed size to the padded size (a static KV cache read or written
as ``cache[:s]``, ``cache[c:c + s]``) is row-wise: at the gear its pad rows are the rows
of the tensor past the real size. Where the graph writes into such a slice of a graph
input (in place, or through ``slice_scatter`` before the copy back), the call is
accepted and the written rows past the real size are recorded as a :class:`RowWrite`:
:class:`graphgear.padding.PaddedCall` saves them before the padded call and puts them
back after it, so the input's state equals an unpadded call's. A write into such a slice
of a tensor the graph made is refused.

The check knows the op families above; other ops (indexing with tensor indices, custom
kernels) are taken as row-wise, as before.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable
from typing import Any

import sympy
import torch
from torch import fx

from .._torch.ops import OpOverload, op_name, op_schema
from ..shapes import padded_dims

__all__ = ["PaddingHazard", "RowWrite", "padding_checks", "padding_hazards"]

#: ops whose output loses a reduced dim (or all of them)
_REDUCTIONS = frozenset({
    "sum", "mean", "amax", "amin", "prod", "var", "std", "var_mean", "std_mean", "logsumexp",
    "any", "all", "max", "min", "argmax", "argmin", "norm", "linalg_vector_norm", "nansum",
    "count_nonzero", "aminmax", "nanmean", "median", "nanmedian", "mode", "kthvalue",
})
#: ops that reorder or mix along their ``dim`` / ``dims`` and keep the shape
_ALONG_DIM = {
    "_softmax": "dim", "_log_softmax": "dim", "softmax": "dim", "log_softmax": "dim",
    "flip": "dims", "roll": "dims", "sort": "dim", "argsort": "dim", "topk": "dim",
    "_safe_softmax": "dim", "rev": "dims",
}
#: matrix products: (the left operand's argument, the right's)
_PRODUCTS = {"mm": ("self", "mat2"), "bmm": ("self", "mat2"), "addmm": ("mat1", "mat2"),
             "baddbmm": ("batch1", "batch2"), "addbmm": ("batch1", "batch2"),
             "mv": ("self", "vec"), "dot": ("self", "tensor"), "matmul": ("self", "other")}
#: attention ops: (key, mask argument or None, causal argument)
_ATTENTION = {
    "scaled_dot_product_attention": ("key", "attn_mask", "is_causal"),
    "_scaled_dot_product_flash_attention_for_cpu": ("key", "attn_mask", "is_causal"),
    "_scaled_dot_product_flash_attention": ("key", None, "is_causal"),
    "_scaled_dot_product_efficient_attention": ("key", "attn_bias", "is_causal"),
    "_scaled_dot_product_cudnn_attention": ("key", "attn_bias", "is_causal"),
}
#: comparisons and logic: a tensor made by one is a mask
_MASK_DTYPES = (torch.bool,)
#: the size arguments of these ops may hold the padded size (shapes, not values)
#: (``SymInt[]`` prints as ``List[int]`` in torch 2.13's schema types)
_SHAPE_ARG_TYPES = ("List[int]", "Optional[List[int]]", "SymInt[]", "SymInt[]?")
#: ops whose SymInt arguments are checked one by one below (not as values)
_INDEXING = frozenset({"slice", "select", "narrow", "arange", "iota", "sym_size", "sym_stride", "sym_numel"})
_BIG = 2 ** 62


@dataclasses.dataclass(frozen=True)
class PaddingHazard:
    """A node whose result changes when geared ``symbols`` are padded."""

    node: str
    target: str
    reason: str
    symbols: frozenset[int]  # indices into ShapeInfo.symbols


@dataclasses.dataclass(frozen=True)
class RowWrite:
    """Graph input ``input`` (a placeholder index) is written at rows ``[start, start +
    s)`` of its dim ``dim``, of fixed size, where ``s`` is geared symbol ``symbol``: at a
    gear above the real size of ``s``, the rows from ``start`` + the real size to
    ``start`` + the gear get the pad rows' values."""

    input: int
    dim: int
    start: int
    symbol: int  # an index into ShapeInfo.symbols


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else n


def _tensors(v: Any) -> Iterable[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, list | tuple):
        for x in v:
            yield from _tensors(x)


def _syms_of(x: Any, index: dict[Any, int]) -> frozenset[int]:
    """Geared symbols inside a SymInt (or a node whose value is one)."""
    v = _val(x)
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        return frozenset(index[s] for s in v.node.expr.free_symbols if s in index)
    return frozenset()


def _packet(node: fx.Node) -> str | None:
    t = node.target
    if isinstance(t, OpOverload) and t.namespace in ("aten", "prims"):
        return op_name(t).split(".", 1)[1]
    return None


def _kwargs(node: fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name (defaults filled in)."""
    schema = op_schema(node.target)
    out: dict[str, Any] = {}
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out[a.name] = node.args[i]
        elif a.name in node.kwargs:
            out[a.name] = node.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _as_dims(dim: Any, ndim: int) -> list[int] | None:
    """Dims from a ``dim`` argument; None means every dim."""
    if dim is None or (isinstance(dim, list | tuple) and not dim):
        return None
    dims = dim if isinstance(dim, list | tuple) else [dim]
    return [int(d) % max(ndim, 1) for d in dims if isinstance(d, int)]


def _along(padded: dict[int, int], dims: list[int] | None) -> set[int]:
    """The symbols of the padded dims (``padded_dims``) among ``dims`` (None: every dim)."""
    return set(padded.values()) if dims is None else {padded[d] for d in dims if d in padded}


class _Checker:
    def __init__(self, gm: fx.GraphModule, symbols: list[Any], geared: Iterable[int]) -> None:
        self.gm = gm
        self.index = {symbols[i]: i for i in geared}
        self.found: list[PaddingHazard] = []
        self.row_writes: list[RowWrite] = []
        self.inputs = {p: i for i, p in enumerate(gm.graph.find_nodes(op="placeholder"))}
        self.mask_seen: dict[fx.Node, bool] = {}

    def hazard(self, node: fx.Node, syms: Iterable[int], reason: str) -> None:
        s = frozenset(syms)
        if s:
            self.found.append(PaddingHazard(node.name, str(node.target), reason, s))

    def run(self) -> list[PaddingHazard]:
        for node in self.gm.graph.nodes:
            if node.op != "call_function":
                continue
            name = _packet(node)
            if name is None:
                continue  # SymInt arithmetic (operator.*) and getitem: values flow on
            try:
                kw = _kwargs(node)
            except Exception:  # noqa: BLE001 - an op without a schema we can read
                continue
            self.values(node, name, kw)
            self.mixing(node, name, kw)
        return self.found

    # -- the padded size used as a number ------------------------------------------
    def values(self, node: fx.Node, name: str, kw: dict[str, Any]) -> None:
        schema = op_schema(node.target)
        if name in _INDEXING:
            self.indexing(node, name, kw)
            return
        if name == "slice_scatter" and self.fixed_rows_scatter(node, kw):
            return
        for a in schema.arguments:
            if str(a.type) in _SHAPE_ARG_TYPES or a.name not in kw:
                continue
            v = kw[a.name]
            syms = set()
            for x in v if isinstance(v, list | tuple) else [v]:
                syms |= _syms_of(x, self.index)
            self.hazard(node, syms, f"uses the padded size as a value (argument {a.name!r})")

    def indexing(self, node: fx.Node, name: str, kw: dict[str, Any]) -> None:
        if name not in ("slice", "select", "narrow"):
            return  # arange(s): row i is i at any size; sym_size: a shape
        src = _val(kw.get("self"))
        if not isinstance(src, torch.Tensor):
            return
        dim = int(kw.get("dim", 0)) % max(src.dim(), 1)
        size = src.shape[dim] if src.dim() else None
        padded = padded_dims(src, self.index).get(dim)
        if name == "select":
            idx = kw.get("index")
            syms = set(_syms_of(idx, self.index))
            if padded is not None and isinstance(idx, int) and idx < 0:
                syms.add(padded)
            self.hazard(node, syms, f"indexes from the end of a padded dim (index {idx})")
            return
        if name == "narrow":
            start = kw.get("start")
            syms = set(_syms_of(start, self.index)) | set(_syms_of(kw.get("length"), self.index))
            if padded is not None and isinstance(start, int) and start < 0:
                syms.add(padded)
            self.hazard(node, syms, "narrows a padded dim from its end")
            return
        if padded is None and self.fixed_rows_slice(node, kw, dim):
            return
        start, end = kw.get("start"), kw.get("end")
        syms = set(_syms_of(start, self.index))
        if padded is not None and isinstance(start, int) and start < 0:
            syms.add(padded)
        end_v = _val(end)
        full = end is None or (isinstance(end, int) and end >= _BIG) or (
            isinstance(end_v, torch.SymInt) and isinstance(size, torch.SymInt)
            and end_v.node.expr == size.node.expr)
        if not full:
            syms |= _syms_of(end, self.index)
            if padded is not None and isinstance(end, int) and end < 0:
                syms.add(padded)
        self.hazard(node, syms, f"slices a padded dim from its end (start {start}, end {end})")

    # -- a dim of fixed size sliced to the padded size (a static KV cache) -------------
    def _fixed_rows(self, node: fx.Node, kw: dict[str, Any], dim: int, sized: Any) -> int | None:
        """The geared symbol ``s`` when ``node`` covers rows ``[start, start + s)`` of dim
        ``dim`` of its ``self``, a dim of fixed size (``sized``: the tensor whose dim ``dim``
        has the covered size ``s`` itself); None otherwise."""
        base = _val(kw.get("self"))
        start = kw.get("start")
        start = 0 if start is None else start
        if not isinstance(base, torch.Tensor) or not isinstance(start, int) or start < 0 or kw.get("step", 1) != 1:
            return None
        if dim in padded_dims(base, self.index):
            return None
        return padded_dims(sized, self.index).get(dim)

    def fixed_rows_slice(self, node: fx.Node, kw: dict[str, Any], dim: int) -> bool:
        """``t[c:c + s]`` of a dim of fixed size: row-wise. Written in place (through views):
        a :class:`RowWrite` where ``t`` is a graph input, a hazard otherwise."""
        sym = self._fixed_rows(node, kw, dim, _val(node))
        if sym is None:
            return False
        if _written_in_place(node):
            self.fixed_write(node, kw, dim, sym)
        return True

    def fixed_rows_scatter(self, node: fx.Node, kw: dict[str, Any]) -> bool:
        """``slice_scatter(t, src, dim, c, c + s)``, ``src`` of the padded size: the
        functional form of a write into ``t[c:c + s]``."""
        base = _val(kw.get("self"))
        if not isinstance(base, torch.Tensor):
            return False
        dim = int(kw.get("dim", 0)) % max(base.dim(), 1)
        sym = self._fixed_rows(node, kw, dim, _val(kw.get("src")))
        if sym is None or not (_syms_of(kw.get("end"), self.index) <= {sym}):
            return False
        self.fixed_write(node, kw, dim, sym)
        return True

    def fixed_write(self, node: fx.Node, kw: dict[str, Any], dim: int, sym: int) -> None:
        base = kw.get("self")
        start = kw.get("start") or 0
        if base in self.inputs:
            self.row_writes.append(RowWrite(self.inputs[base], dim, start, sym))
        else:
            self.hazard(node, {sym}, f"writes a slice [{start}:{start} + size] of dim {dim} of a tensor of "
                                     "fixed size the graph made: the pad rows would land in its rows past the "
                                     "real size, which real rows may read")

    # -- mixing along a padded dim -------------------------------------------------
    def mixing(self, node: fx.Node, name: str, kw: dict[str, Any]) -> None:
        if name in _REDUCTIONS:
            src = _val(node.args[0]) if node.args else None
            dims = _as_dims(kw.get("dim"), src.dim()) if isinstance(src, torch.Tensor) else None
            if self.masked_scores(node.args[0] if node.args else None, dims):
                return
            had = {s for a in node.all_input_nodes for v in _tensors(_val(a))
                   for s in padded_dims(v, self.index).values()}
            kept = {s for v in _tensors(_val(node)) for s in padded_dims(v, self.index).values()}
            along = set()
            if isinstance(src, torch.Tensor) and "dim" in kw:
                along = _along(padded_dims(src, self.index), dims)
            self.hazard(node, (had - kept) | along, "reduces over a padded dim")
        elif name in _ALONG_DIM:
            src = _val(node.args[0]) if node.args else None
            if not isinstance(src, torch.Tensor):
                return
            dims = _as_dims(kw.get(_ALONG_DIM[name]), src.dim())
            syms = _along(padded_dims(src, self.index), dims)
            if syms and "softmax" in name and self.masked_scores(node.args[0], dims):
                return
            self.hazard(node, syms, f"mixes or reorders values along a padded dim ({name})")
        elif name in _PRODUCTS:
            left, right = (_val(kw.get(a)) for a in _PRODUCTS[name])
            if not isinstance(left, torch.Tensor) or not isinstance(right, torch.Tensor):
                return
            k = padded_dims(left, self.index).get(left.dim() - 1)
            if k is None or self.masked_scores(kw.get(_PRODUCTS[name][0]), [left.dim() - 1]):
                return
            self.hazard(node, {k}, "a matrix product contracts over a padded dim")
        elif name in _ATTENTION:
            k_arg, mask_arg, causal_arg = _ATTENTION[name]
            key = _val(kw.get(k_arg))
            if not isinstance(key, torch.Tensor) or key.dim() < 2:
                return
            s = padded_dims(key, self.index).get(key.dim() - 2)
            masked = (mask_arg is not None and kw.get(mask_arg) is not None) or bool(kw.get(causal_arg))
            if s is not None and not masked:
                self.hazard(node, {s}, "attention over padded keys with neither a mask nor is_causal")
        elif name in ("native_layer_norm", "_fused_rms_norm"):
            src = _val(kw.get("input"))
            if isinstance(src, torch.Tensor):
                n = len(kw.get("normalized_shape") or ())
                pd = padded_dims(src, self.index)
                self.hazard(node, {s for d, s in pd.items() if d >= src.dim() - n},
                            "a layer norm over a padded dim")
        elif name == "native_group_norm":
            src = _val(kw.get("input"))
            if isinstance(src, torch.Tensor):
                self.hazard(node, {s for d, s in padded_dims(src, self.index).items() if d >= 1},
                            "a group norm over a padded dim")
        elif name in ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
                      "batch_norm"):
            src = _val(kw.get("input"))
            if isinstance(src, torch.Tensor) and kw.get("training"):
                self.hazard(node, {s for d, s in padded_dims(src, self.index).items() if d != 1},
                            "batch norm in training reduces over a padded dim")

    def masked_scores(self, x: Any, dims: set[int] | list[int] | None) -> bool:
        """Whether mixing ``x`` along ``dims`` is attention over masked scores: only its
        last dim, ``x`` has a padded query dim besides (two padded dims), and it was
        built with a boolean mask (a causal mask from position comparisons, a padding
        mask). Softmax, its spelled-out reductions and the product with the values."""
        v = _val(x)
        if not isinstance(x, fx.Node) or not isinstance(v, torch.Tensor) or v.dim() < 2:
            return False
        if dims is None or set(dims) != {v.dim() - 1} or len(padded_dims(v, self.index)) < 2:
            return False
        if x in self.mask_seen:
            return self.mask_seen[x]
        seen: set[fx.Node] = set()
        todo = [x]
        found = False
        while todo and len(seen) < 128:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if any(t.dtype in _MASK_DTYPES for t in _tensors(_val(n))):
                found = True
                break
            todo.extend(n.all_input_nodes)
        self.mask_seen[x] = found
        return found


def _written_in_place(node: fx.Node, depth: int = 0) -> bool:
    """Whether an op writes ``node``'s value in place, directly or through a view of it."""
    for user in node.users:
        if user.op != "call_function":
            continue
        if user.target is operator.getitem:  # an element of a view op's tuple (unbind, split)
            if depth < 8 and _written_in_place(user, depth + 1):
                return True
            continue
        if not isinstance(user.target, OpOverload):
            continue
        schema = op_schema(user.target)
        for i, a in enumerate(schema.arguments):
            v = user.args[i] if i < len(user.args) else user.kwargs.get(a.name)
            if v is not node or a.alias_info is None:
                continue
            if a.alias_info.is_write:
                return True
            if depth < 8 and _written_in_place(user, depth + 1):  # a view: its writes are ours
                return True
    return False


def padding_checks(gm: fx.GraphModule, symbols: list[Any],
                   geared: Iterable[int]) -> tuple[list[PaddingHazard], list[RowWrite]]:
    """The nodes of ``gm`` whose result changes when the ``geared`` symbols (indices into
    ``symbols``) are zero-padded, and the rows of graph inputs past the real size that a
    padded call writes (see the module docstring)."""
    geared = [i for i in geared if isinstance(symbols[i], sympy.Symbol)]
    if not geared:
        return [], []
    checker = _Checker(gm, symbols, geared)
    return checker.run(), checker.row_writes


def padding_hazards(gm: fx.GraphModule, symbols: list[Any], geared: Iterable[int]) -> list[PaddingHazard]:
    """Every node of ``gm`` whose result changes when the ``geared`` symbols (indices
    into ``symbols``) are zero-padded (see the module docstring)."""
    return padding_checks(gm, symbols, geared)[0]


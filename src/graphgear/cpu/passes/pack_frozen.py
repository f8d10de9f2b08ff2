"""The frozen-weight passes of a static CPU compile (``frozen_parameter``, decode batches):
``group_frozen_products``, ``pack_frozen_small`` and ``pack_frozen_linears``, run in that
order by ``compilers.inductor.compile_static`` (see :func:`graphgear.cpu.passes.frozen_passes`).

A decode step multiplies a few rows (the batch) by every weight matrix. ATen's
``addmm``/``mm`` (MKL ``sgemm``) re-packs the weight panel on each call, which at small M
costs as much as the product itself, and Inductor's one-row decomposition
(``decompose_mm_pass``) and C++ GEMM template reach well below MKL's packed rate;
MKL's packed GEMM (``mkl::_mkl_linear`` over a weight packed once by
``mkl::_mkl_reorder_linear_weight``, the ops Inductor's own ``freezing`` uses for fp32
linears) does not re-pack. The served step is faster with it, by less than the product
alone is, because the template's products sit inside generated C++ with no call
overhead (benchmarks/bench_decode.py; the figures: benchmarks/RESULTS.md,
"bench_decode.py history").

Products of 2 to 16 rows go to graphgear's own small-batch product first
(:func:`pack_frozen_small`, :mod:`graphgear.cpu.kernels.small_gemm_kernel`: faster, and it
keeps the generated code straight-line), or, where their weights outgrow the last-level
cache (:func:`small_products_stream`), to graphgear's row-major product on the frozen
weights as they lie (:mod:`.route_small_linear`); MKL takes the rest, and all of them
where those kernels cannot be built.

:func:`pack_frozen_linears` rewrites, in a static graph whose weights are constants
(``get_attr``: graphgear froze them), every ``mm(x, W.T)`` / ``addmm(b, x, W.T)`` whose
``W`` is a 2-D fp32 CPU constant and whose ``x`` has a static row count ``M`` in
``[min_rows, max_rows]`` into ``mkl::_mkl_linear(x, packed, W, b, M)``. Inductor calls
it as an extern kernel. The packed copy is made at compile time: a parameter changed
in place afterwards is not seen, which is what ``frozen_parameter`` promises already.
Without MKL (``torch.backends.mkl.is_available()`` false) nothing is rewritten.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx

from ...passes.manager import GraphPass
from ..frozen import FrozenCopies, copy_of
from ..kernels import small_gemm_kernel as small_gemm
from .rewrite import replace_node, transposed

log = logging.getLogger(__name__)

__all__ = ["MAX_ROWS", "MIN_ROWS", "GroupFrozenProducts", "PackFrozenLinears", "PackFrozenSmall",
           "group_frozen_products", "last_level_cache_bytes", "mkl_packing_available", "pack_frozen_linears",
           "pack_frozen_small", "small_products_stream"]

aten = torch.ops.aten

#: row counts packed: the decode batches above 1. At one row Inductor's decomposed
#: product fuses with its neighbours and was faster in the served step
#: (benchmarks/bench_decode.py)
MIN_ROWS = 2
MAX_ROWS = 64


def mkl_packing_available() -> bool:
    """Whether this torch has MKL and its packed-linear ops."""
    return bool(torch.backends.mkl.is_available()) and hasattr(torch.ops.mkl, "_mkl_linear")


#: the last-level cache assumed where the system does not say (Linux's sysfs does)
DEFAULT_CACHE_BYTES = 32 << 20


@functools.cache
def last_level_cache_bytes() -> int:
    """The size of the CPU's last-level cache (Linux: ``/sys/devices/system/cpu/cpu0/cache``;
    elsewhere, or unreadable, :data:`DEFAULT_CACHE_BYTES`)."""
    best = (0, DEFAULT_CACHE_BYTES)
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit() and level > best[0]:
            best = (level, int(digits) * unit)
    return best[1]


def _constant(gm: fx.GraphModule, node: object) -> torch.Tensor | None:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    value = getattr(gm, str(node.target), None)
    return value if isinstance(value, torch.Tensor) else None


def _transposed_weight(gm: fx.GraphModule, node: object) -> fx.Node | None:
    """The ``get_attr`` node of ``W`` when ``node`` is ``W.T`` (``t`` or ``permute(1, 0)``)
    of a 2-D contiguous fp32 CPU constant."""
    src = transposed(node)
    w = _constant(gm, src)
    if (w is None or w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu"
            or not w.is_contiguous() or w.requires_grad):
        return None
    assert isinstance(src, fx.Node)
    return src


def _frozen_product(gm: fx.GraphModule, node: fx.Node, min_rows: int,
                    max_rows: int) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """``(x, W's get_attr node, bias node or None)`` when ``node`` is ``mm(x, W.T)`` or
    ``addmm(b, x, W.T)`` (beta = alpha = 1, ``b`` a 1-D fp32 constant of ``W``'s rows)
    with ``W`` a frozen 2-D contiguous fp32 CPU constant and ``x`` a 2-D fp32 value of
    ``min_rows`` to ``max_rows`` static rows; else None."""
    if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
        return None
    if node.target is aten.addmm.default:
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return None
        bias, x, wt = node.args[:3]
        b = _constant(gm, bias)
        if b is None or b.dim() != 1 or b.dtype != torch.float32:
            return None
    else:
        bias, b = None, None
        x, wt = node.args[:2]
    w_node = _transposed_weight(gm, wt)
    xv = x.meta.get("val") if isinstance(x, fx.Node) else None
    if w_node is None or not isinstance(xv, torch.Tensor) or xv.dim() != 2 or xv.dtype != torch.float32:
        return None
    rows = xv.shape[0]
    if not isinstance(rows, int) or not min_rows <= rows <= max_rows:
        return None
    w = _constant(gm, w_node)
    if w is None or (b is not None and b.shape[0] != w.shape[0]):
        return None
    return x, w_node, bias


def pack_frozen_linears(gm: fx.GraphModule, *, min_rows: int = MIN_ROWS, max_rows: int = MAX_ROWS,
                        copies: FrozenCopies | None = None) -> int:
    """Rewrite ``gm``'s small-M products with frozen weights to MKL's packed GEMM (see
    the module docstring); returns how many were rewritten. ``gm``'s nodes need their
    ``val`` metadata (fake tensors of static shapes). ``copies``: the packed weights
    are made there once for all the graph's gears."""
    if not mkl_packing_available():
        return 0
    g = gm.graph
    packed: dict[tuple[str, int], str] = {}
    count = 0
    for node in list(g.nodes):
        found = _frozen_product(gm, node, min_rows, max_rows)
        if found is None:
            continue
        x, w_node, bias = found
        rows = x.meta["val"].shape[0]
        w = _constant(gm, w_node)
        assert w is not None
        name = packed.get((str(w_node.target), rows))
        if name is None:
            name = f"_graphgear_mkl_packed_{len(packed)}"
            gm.register_buffer(name, copy_of(copies, "mkl", [w], lambda w=w, rows=rows:
                                             torch.ops.mkl._mkl_reorder_linear_weight(w, rows), extra=(rows,)))
            packed[(str(w_node.target), rows)] = name
        replace_node(g, node, lambda x=x, name=name, w_node=w_node, bias=bias, rows=rows: g.call_function(
            torch.ops.mkl._mkl_linear.default, (x, g.get_attr(name), w_node, bias, rows)))
        count += 1
    if count:
        g.eliminate_dead_code()
        gm.recompile()
        log.debug("graphgear: %d matrix products packed for MKL (%d packed weights)", count, len(packed))
    return count


def small_products_stream(gm: fx.GraphModule) -> bool:
    """Whether the frozen weights of ``gm``'s products of :data:`small_gemm.MIN_ROWS` to
    :data:`small_gemm.MAX_ROWS` rows together outgrow the last-level cache
    (:func:`last_level_cache_bytes`): then every step reads them from memory, where
    graphgear's row-major product streams the frozen weight itself faster than
    :func:`pack_frozen_small`'s packed copy, which also doubles the weights' memory.
    Where they fit, the packed copy is faster (benchmarks/bench_decode.py, its small and
    large models; the figures: benchmarks/RESULTS.md, "bench_decode.py history")."""
    weights: dict[str, int] = {}
    for node in gm.graph.nodes:
        found = _frozen_product(gm, node, small_gemm.MIN_ROWS, small_gemm.MAX_ROWS)
        if found is not None:
            w = _constant(gm, found[1])
            assert w is not None
            weights[str(found[1].target)] = w.nbytes
    return sum(weights.values()) > last_level_cache_bytes()


def pack_frozen_small(gm: fx.GraphModule, copies: FrozenCopies | None = None) -> int:
    """Rewrite ``gm``'s products with frozen weights of :data:`small_gemm.MIN_ROWS` to
    :data:`small_gemm.MAX_ROWS` rows to graphgear's own packed product
    (``graphgear::packed_linear``, :mod:`graphgear.cpu.kernels.small_gemm_kernel`); returns how
    many. Run before :func:`pack_frozen_linears`, which packs what is left for MKL.
    Nothing is rewritten where the kernel cannot be built here.

    One-row products are not packed. Those Inductor decomposes stay its fused loops:
    they fuse with their neighbours, and were faster in the served step. Those too wide
    for its one-row decomposition (``decompose_mm_pass``: a real model's MLP and
    vocabulary products, which would stay ATen's ``sgemv``) go to graphgear's row-major
    product on the frozen weight itself (:mod:`.route_small_linear`), which streams it
    faster than the packed product and needs no packed copy (benchmarks/bench_decode.py;
    the figures: benchmarks/RESULTS.md, "bench_decode.py history")."""
    g = gm.graph
    found_any = [(n, f) for n in g.nodes
                 if (f := _frozen_product(gm, n, small_gemm.MIN_ROWS, small_gemm.MAX_ROWS)) is not None]
    if not found_any or small_gemm.kernel() is None:
        return 0
    packed: dict[str, str] = {}
    for node, (x, w_node, bias) in found_any:
        w = _constant(gm, w_node)
        assert w is not None
        name = packed.get(str(w_node.target))
        if name is None:
            name = f"_graphgear_small_packed_{len(packed)}"
            gm.register_buffer(name, copy_of(copies, "small", [w], lambda w=w: small_gemm.pack_weight(w.detach())))
            packed[str(w_node.target)] = name
        b_name = None
        if bias is not None:
            b = _constant(gm, bias)
            assert b is not None
            b_name = f"{name}_bias_{node.name}"
            gm.register_buffer(b_name, copy_of(copies, "small bias", [b], lambda b=b: small_gemm.pack_bias(b.detach())))
        replace_node(g, node, lambda x=x, name=name, b_name=b_name, n=w.shape[0]: g.call_function(
            torch.ops.graphgear.packed_linear.default,
            (x, g.get_attr(name), None if b_name is None else g.get_attr(b_name), n)))
    g.eliminate_dead_code()
    gm.recompile()
    log.debug("graphgear: %d matrix products packed for graphgear's small-batch product", len(found_any))
    return len(found_any)


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _rows_source(x: fx.Node) -> object:
    """What a product's rows are, up to a view: the traced graph gives each linear of the
    same hidden state its own ``view`` node, equal in source and shape."""
    if x.op == "call_function" and x.target in _VIEWS:
        return (x.args[0], tuple(x.args[1]))
    return x


def group_frozen_products(gm: fx.GraphModule, *, min_rows: int = MIN_ROWS, max_rows: int = MAX_ROWS,
                          copies: FrozenCopies | None = None) -> int:
    """Rewrite products that multiply the same rows by different frozen weights (a
    decoder layer's query, key and value projections; its gate and up projections) into
    one product over the weights concatenated, followed by a slice per product; returns
    how many groups were made. Run before :func:`pack_frozen_linears`, which then packs
    one weight per group: fewer, larger MKL calls.

    Grouped are ``mm(x, W.T)`` (or all ``addmm(b, x, W.T)`` with a constant bias) with
    ``W`` a 2-D contiguous fp32 CPU constant and ``x`` of ``min_rows`` to ``max_rows``
    static rows. The concatenated weight is a new constant of the graph (a copy of the
    grouped weights, kept with the compiled code like the packed copy). Fewer, larger
    calls make the served step faster (benchmarks/bench_decode.py; the figures:
    benchmarks/RESULTS.md, "bench_decode.py history")."""
    if not mkl_packing_available() and small_gemm.kernel() is None:
        return 0
    g = gm.graph
    groups: dict[tuple[object, bool], list[tuple[fx.Node, fx.Node, fx.Node, object]]] = {}
    for node in g.nodes:
        found = _frozen_product(gm, node, min_rows, max_rows)
        if found is not None:
            x, w_node, bias = found
            groups.setdefault((_rows_source(x), bias is not None), []).append((node, x, w_node, bias))
    made = 0
    for (_, has_bias), members in groups.items():
        if len(members) < 2:
            continue
        first, x = members[0][0], members[0][1]  # graph order: the first product's rows
        weights = [_constant(gm, w) for _, _, w, _ in members]
        name = f"_graphgear_grouped_weight_{made}"
        gm.register_buffer(name, copy_of(copies, "concat", weights, lambda ws=weights: torch.cat(ws).contiguous()))
        if has_bias:
            biases = [_constant(gm, b) for *_, b in members]
            gm.register_buffer(f"{name}_bias", copy_of(copies, "concat", biases, lambda bs=biases: torch.cat(bs)))
        xv = x.meta["val"]
        total = sum(w.shape[0] for w in weights)
        with g.inserting_before(first):
            w_all = g.call_function(aten.permute.default, (g.get_attr(name), [1, 0]))
            if has_bias:
                prod = g.call_function(aten.addmm.default, (g.get_attr(f"{name}_bias"), x, w_all))
            else:
                prod = g.call_function(aten.mm.default, (x, w_all))
            prod.meta["val"] = xv.new_empty((xv.shape[0], total))
            start = 0
            for (node, *_), w in zip(members, weights):
                part = g.call_function(aten.slice.Tensor, (prod, 1, start, start + w.shape[0]))
                part.meta["val"] = prod.meta["val"][:, start:start + w.shape[0]]
                own = g.call_function(aten.clone.default, (part,), {"memory_format": torch.contiguous_format})
                own.meta = dict(node.meta)
                node.replace_all_uses_with(own)
                start += w.shape[0]
        for node, *_ in members:
            g.erase_node(node)
        made += 1
    if made:
        g.eliminate_dead_code()
        gm.recompile()
        log.debug("graphgear: %d groups of products with the same rows made one product each", made)
    return made


class GroupFrozenProducts(GraphPass):
    """:func:`group_frozen_products` over products of ``min_rows`` to :data:`MAX_ROWS`
    rows, its copies made in ``copies``."""

    name = "group_frozen_products"
    static_sizes = True  # the row counts

    def __init__(self, *, min_rows: int = MIN_ROWS, copies: FrozenCopies | None = None) -> None:
        self.min_rows = min_rows
        self.copies = copies

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
        return group_frozen_products(gm, min_rows=self.min_rows, copies=self.copies)


class PackFrozenSmall(GraphPass):
    """:func:`pack_frozen_small`, its copies made in ``copies``; ``stream``: the weights
    outgrow the cache (:func:`small_products_stream`), nothing is packed."""

    name = "pack_frozen_small"
    static_sizes = True

    def __init__(self, *, copies: FrozenCopies | None = None, stream: bool = False) -> None:
        self.copies = copies
        self.stream = stream

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
        return 0 if self.stream else pack_frozen_small(gm, self.copies)


class PackFrozenLinears(GraphPass):
    """:func:`pack_frozen_linears` over products of ``min_rows`` to :data:`MAX_ROWS`
    rows, its copies made in ``copies``."""

    name = "pack_frozen_linears"
    static_sizes = True

    def __init__(self, *, min_rows: int = MIN_ROWS, copies: FrozenCopies | None = None) -> None:
        self.min_rows = min_rows
        self.copies = copies

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
        return pack_frozen_linears(gm, min_rows=self.min_rows, copies=self.copies)

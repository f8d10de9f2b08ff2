"""Frozen CPU weights packed for MKL's GEMM (``frozen_parameter``, decode batches).

A decode step multiplies a few rows (the batch) by every weight matrix. ATen's
``addmm``/``mm`` (MKL ``sgemm``) re-packs the weight panel on each call, which at small M
costs as much as the product itself, and Inductor's one-row decomposition
(``decompose_mm_pass``) and C++ GEMM template reach about half of MKL's packed rate;
MKL's packed GEMM (``mkl::_mkl_linear`` over a weight packed once by
``mkl::_mkl_reorder_linear_weight``, the ops Inductor's own ``freezing`` uses for fp32
linears) does not re-pack.

Measured side by side (2026-12-01, 1 thread, this project's 2-core CPU, which varied by
2x during the day, so only same-run ratios count): one ``nn.Linear`` K = 256, N = 2048,
M = 8: ATen 344 µs, Inductor's C++ template 377 µs (dynamo's call included, ~35 µs),
packed 164 µs. In the whole served step of bench_decode's Qwen2 (hidden 256, 29 products
a step, each an extern call) the gain is smaller, because the template's products sit
inside generated C++ with no call overhead: batch 8 4385 -> 4099 µs, 4171 -> 4052 µs
(two runs); hidden 1024 (128 MB of weights, past the caches) batch 8 23.4 -> 22.2 ms.

Products of 2 to 16 rows go to graphgear's own small-batch product first
(:func:`pack_frozen_small`, :mod:`graphgear.kernels.small_gemm`: faster, and it keeps the generated code
straight-line), or, where their weights outgrow the last-level cache
(:func:`small_products_stream`), to graphgear's row-major product on the frozen weights
as they lie (:mod:`graphgear.compilers.small_linear`); MKL takes the rest, and all of
them where those kernels cannot be built.

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
from pathlib import Path

import torch
from torch import fx

from ..kernels import small_gemm
from .frozen import FrozenCopies, copy_of

log = logging.getLogger(__name__)

__all__ = ["MAX_ROWS", "MIN_ROWS", "group_frozen_products", "last_level_cache_bytes", "mkl_packing_available",
           "pack_frozen_linears", "pack_frozen_small", "small_products_stream"]

aten = torch.ops.aten

#: row counts packed: the decode batches above 1. At one row Inductor's decomposed
#: product fuses with its neighbours and was faster in the model (Qwen2 hidden 256,
#: served step 3113 µs unpacked, 3455 µs packed, same run)
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
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.t.default:
        src = node.args[0]
    elif node.target is aten.permute.default and list(node.args[1]) == [1, 0]:
        src = node.args[0]
    else:
        return None
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
        with g.inserting_before(node):
            p_node = g.get_attr(name)
            new = g.call_function(torch.ops.mkl._mkl_linear.default, (x, p_node, w_node, bias, rows))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        g.erase_node(node)
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
    :func:`pack_frozen_small`'s packed copy, which also doubles the weights' memory
    (2026-12-03, bench_decode's large Qwen2, 128 MB of weights, served step at batch 8,
    same run, packed / streamed by this rule: 2 threads 21566 / 16892 µs; an earlier A/B
    with the products grouped and MKL off, packed / row-major: 1 thread 22980 / 19294,
    2 threads 16920 / 13909).
    Where they fit, the packed copy is faster (small Qwen2, 11.6 MB in a 32 MB cache,
    batch 4 944 / 1117 µs, batch 8 2474 / 2626)."""
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
    (``graphgear::packed_linear``, :mod:`graphgear.kernels.small_gemm`); returns how
    many. Run before :func:`pack_frozen_linears`, which packs what is left for MKL.
    Nothing is rewritten where the kernel cannot be built here.

    One-row products are not packed. Those Inductor decomposes stay its fused loops:
    they fuse with their neighbours, and were faster in the model (2026-12-02, served
    step, hidden 256 471 against 530 µs packed, hidden 128 140 against 149 µs). Those
    too wide for its one-row decomposition (``decompose_mm_pass``: a real model's MLP
    and vocabulary products, which would stay ATen's ``sgemv``) go to graphgear's
    row-major product on the frozen weight itself (:mod:`.small_linear`), which streams
    it faster than the packed product and needs no packed copy (2026-12-03, the large
    bench model's MLP products and a 151936 x 896 vocabulary, from DRAM, same run,
    packed / row-major: 1 thread 53.1 / 43.7 ms, 2 threads 31.7 / 26.9)."""
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
        b_node = None
        if bias is not None:
            b = _constant(gm, bias)
            assert b is not None
            b_name = f"{name}_bias_{node.name}"
            gm.register_buffer(b_name, copy_of(copies, "small bias", [b], lambda b=b: small_gemm.pack_bias(b.detach())))
        with g.inserting_before(node):
            p_node = g.get_attr(name)
            if bias is not None:
                b_node = g.get_attr(b_name)
            new = g.call_function(torch.ops.graphgear.packed_linear.default, (x, p_node, b_node, w.shape[0]))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        g.erase_node(node)
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
    grouped weights, kept with the compiled code like the packed copy). Measured on
    bench_decode's small Qwen2 served step (29 products -> 17 calls; 1 thread, same run,
    grouped / separate): batch 2 0.90 and 0.78, batch 4 0.87, batch 8 0.85."""
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

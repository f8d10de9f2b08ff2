"""The ``small_linear`` pass: small-M products with weights read as they lie go to
graphgear's row-major kernel (:mod:`graphgear.cpu.kernels.small_linear_kernel`).

:func:`route_small_products` rewrites, in an inference graph for the CPU, every
``mm(x, W.T)`` / ``addmm(b, x, W.T)`` whose ``x`` has a static row count of
:data:`~graphgear.cpu.kernels.small_linear_kernel.MIN_ROWS` to
:data:`~graphgear.cpu.kernels.small_linear_kernel.MAX_ROWS` and whose ``W`` is a 2-D
contiguous fp32 CPU value (a parameter passed in, as max-autotune and reduce-overhead
without ``frozen_parameter`` see it) into ``graphgear::small_linear(x, W, b)``, which
Inductor calls as an extern kernel. One-row products go there too when ``W`` has a side
wider than Inductor's one-row decomposition takes (``decompose_mm_pass``: a real model's
MLP and vocabulary products), which would leave them to ATen's ``sgemv``; the narrower
ones stay Inductor's loops, fused with their neighbours. Routed, a decode step of a
model whose weights leave the caches is faster in both modes (benchmarks/bench_decode.py;
the figures: benchmarks/RESULTS.md, "bench_decode.py history"). The weight is read as it
is on every call: a parameter changed in place is seen. Frozen graphs pack the weights of
their 2-to-64-row products instead (:mod:`.pack_frozen`); their wide one-row products
come here too, reading the frozen weight (``compile_static``). Nothing is rewritten
where the kernel cannot be built here.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from ..._torch.inductor_passes import inductor_one_row_decompose_limit
from ...passes.manager import GraphPass
from ..kernels import small_linear_kernel
from .rewrite import replace_node, transposed

log = logging.getLogger(__name__)

__all__ = ["RouteSmallLinear", "route_small_products"]

aten = torch.ops.aten


def _fp32_cpu(node: object, dim: int) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    if (not isinstance(v, torch.Tensor) or v.dim() != dim or v.dtype != torch.float32
            or v.device.type != "cpu" or v.requires_grad):
        return None
    return v


def _weight(node: object) -> fx.Node | None:
    """``W`` when ``node`` is ``W.T`` (``t`` or ``permute(1, 0)``) of a 2-D contiguous
    fp32 CPU value of static size."""
    src = transposed(node)
    w = _fp32_cpu(src, 2)
    if w is None or not all(isinstance(s, int) for s in w.shape) or not w.is_contiguous():
        return None
    assert isinstance(src, fx.Node)
    return src


def _product(node: fx.Node, one_row_limit: int) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default):
        return None
    bias: fx.Node | None = None
    if node.target is aten.addmm.default:
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return None
        b, x, wt = node.args[:3]
        bv = _fp32_cpu(b, 1)
        if bv is None or not isinstance(b, fx.Node):
            return None
        bias = b
    else:
        x, wt = node.args[:2]
    w = _weight(wt)
    xv = _fp32_cpu(x, 2)
    if w is None or xv is None or not isinstance(x, fx.Node):
        return None
    rows = xv.shape[0]
    n, k = w.meta["val"].shape
    if not isinstance(rows, int) or rows > small_linear_kernel.MAX_ROWS or rows < 1:
        return None
    if rows < small_linear_kernel.MIN_ROWS and max(n, k) <= one_row_limit:
        return None  # Inductor's one-row decomposition fuses it with its neighbours
    if bias is not None and bias.meta["val"].shape[0] != n:
        return None
    return x, w, bias


def route_small_products(gm: fx.GraphModule) -> int:
    """Rewrite ``gm``'s small-M products (see the module docstring); returns how many.
    ``gm``'s nodes need their ``val`` metadata."""
    g = gm.graph
    limit = inductor_one_row_decompose_limit()
    found = [(n, f) for n in g.nodes if (f := _product(n, limit)) is not None]
    if not found or small_linear_kernel.kernel() is None:
        return 0
    for node, (x, w, bias) in found:
        replace_node(g, node, lambda x=x, w=w, bias=bias: g.call_function(torch.ops.graphgear.small_linear.default,
                                                                          (x, w, bias)))
    g.eliminate_dead_code()
    gm.recompile()
    log.debug("graphgear: %d small-M products go to graphgear's row-major product", len(found))
    return len(found)


class RouteSmallLinear(GraphPass):
    """:func:`route_small_products` as a pass of the static compile (and of max-autotune's
    inference graphs): inference graphs only (the op has no backward)."""

    inside_regions = True

    name = "small_linear"
    static_sizes = True  # the row counts

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
        return route_small_products(gm)

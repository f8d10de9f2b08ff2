"""Small-M products with weights that are not frozen go to graphgear's row-major kernel.

:func:`route_small_products` rewrites, in an inference graph for the CPU, every
``mm(x, W.T)`` / ``addmm(b, x, W.T)`` whose ``x`` has a static row count of
:data:`~graphgear.kernels.small_linear.MIN_ROWS` to
:data:`~graphgear.kernels.small_linear.MAX_ROWS` and whose ``W`` is a 2-D contiguous
fp32 CPU value (a parameter passed in, as max-autotune and reduce-overhead without
``frozen_parameter`` see it) into ``graphgear::small_linear(x, W, b)``, which Inductor
calls as an extern kernel (:mod:`graphgear.kernels.small_linear`). One-row products go
there too when ``W`` has a side wider than Inductor's one-row decomposition takes
(``decompose_mm_pass``, 2048: a real model's MLP and vocabulary products), which would
leave them to ATen's ``sgemv``; the narrower ones stay Inductor's loops, fused with
their neighbours. Measured in bench_decode's large Qwen2 (hidden 1024, MLP 2816, vocab
8192; batch 1, same run, 2026-12-03, routed / not, ratio to ``torch.compile``):
max-autotune 0.93 / 1.03 at 1 thread, 0.73 / 1.08 at 2; reduce-overhead 0.84 / 0.94
and 0.61 / 0.96. The weight is read as it is on every call: a parameter changed in
place is seen. Frozen graphs pack the weights of their 2-to-64-row products instead
(:mod:`.mkl_pack`); their wide one-row products come here too, reading the frozen
weight (``compile_static``). Nothing is rewritten where the kernel cannot be built
here.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from .._torch.inductor_passes import inductor_one_row_decompose_limit
from ..kernels import small_linear

log = logging.getLogger(__name__)

__all__ = ["route_small_products"]

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
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.t.default or (node.target is aten.permute.default and list(node.args[1]) == [1, 0]):
        src = node.args[0]
    else:
        return None
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
    if not isinstance(rows, int) or rows > small_linear.MAX_ROWS or rows < 1:
        return None
    if rows < small_linear.MIN_ROWS and max(n, k) <= one_row_limit:
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
    if not found or small_linear.kernel() is None:
        return 0
    for node, (x, w, bias) in found:
        with g.inserting_before(node):
            new = g.call_function(torch.ops.graphgear.small_linear.default, (x, w, bias))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        g.erase_node(node)
    g.eliminate_dead_code()
    gm.recompile()
    log.debug("graphgear: %d small-M products go to graphgear's row-major product", len(found))
    return len(found)

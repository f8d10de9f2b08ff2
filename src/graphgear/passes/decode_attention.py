"""Decode attention without ATen's flash kernel: graphgear's one-query kernel, or the
attention written out in aten ops Inductor fuses into its kernels.

At a decode step the query has one position. ATen's CPU flash-attention kernel
(``_scaled_dot_product_flash_attention_for_cpu``) is built for blocks of queries: for
one query it still transposes, allocates its scratch buffers and splits work, a fixed
cost per call that dominates a short context's attention, and it reads every key of the
cache, masked or not.

It rewrites a CPU flash attention when

* the query has one position (a static size), no dropout, ``is_causal=False`` (with one
  query and several keys torch's causal mask would keep the first key only; transformers
  passes a mask instead);
* its log-sum-exp output is unused (inference; a training forward saves it);

into, where every tensor is float32 and the mask is none or ``[1 or B, 1 or H, 1, L]``
(bool or float32) and graphgear's kernel builds here, a call of
``graphgear::decode_attention`` (:mod:`graphgear.cpu.kernels.decode_attention_kernel`: it
reads only the key and value rows the mask lets through, once per key/value head; an
extern kernel, so the code stays straight-line for the CPU graph), at any size: it is
faster than the flash kernel with every position kept, more so with a static cache
partly written, and than the written-out form in the served step
(benchmarks/bench_decode.py; the figures: benchmarks/RESULTS.md, "bench_decode.py
history").

Otherwise (bfloat16 or float16, another mask, no kernel), when the attention is small
(batch x heads x keys x head dim at most :data:`MAX_MACS`: short contexts, where the
flash kernel's fixed cost dominates), into the written-out form: scores as a
product-sum over the head dim, a max-shifted exponent, the weighted sum over keys
normalised once at the end (bfloat16 and float16 computed in float32, as the flash
kernel accumulates), two reductions Inductor generates inline.

Grouped-query attention (fewer key/value heads, as :mod:`.repeat_kv` leaves it) is kept
grouped: query head ``h`` reads key/value head ``h // (H / KV)``. A fully masked row gives
zeros, as the flash kernel does (not NaN).

The pass runs only where Inductor compiles the graph (``max-autotune`` and the CPU graph
of ``reduce-overhead``): run as eager aten ops the written-out form is slower than the
flash kernel.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from .._torch.inductor_passes import inductor_decomp_table, inductor_realize
from ..capture.split import is_split_op
from ..config import mode_of
from ..cpu.kernels import decode_attention_kernel as attention_kernel
from ..shapes import known_equal
from .manager import GraphPass, node_val
from .ops import inline_decompositions
from .patterns import decomp_kind
from .repeat_kv import cpu_flash_attention, only_output_used

aten = torch.ops.aten

__all__ = ["DecodeAttention", "decode_attention"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: The largest attention (batch x heads x keys x head dim multiply-adds) written out
#: (graphgear's kernel takes float32 attention of any size). Past it the flash kernel's
#: blocked products win; below, its fixed cost per call does (benchmarks/bench_decode.py
#: with the pass on and off; the figures: benchmarks/RESULTS.md, "bench_decode.py
#: history"). The query is stored once (``inductor_realize``): inlined, Inductor would
#: recompute its rotary embedding for every key, which made the written-out form slower.
MAX_MACS = 524288


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, dropout_p: float = 0.0,
                     is_causal: bool = False, *, attn_mask: torch.Tensor | None = None,
                     scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What the flash kernel returns for one query position, written out; ``[B, H, 1,
    D]`` query, ``[B, KV, L, D]`` key and value (``H`` a multiple of ``KV``). The second
    output (log-sum-exp) is a placeholder: the pass rewrites only calls that drop it."""
    b, h, _, d = query.shape
    kv, length = key.shape[1], key.shape[2]
    g = h // kv
    dtype = query.dtype
    sc = scale if scale is not None else 1.0 / math.sqrt(d)
    # Stored once: inlined, Inductor would recompute the query (its rotary embedding's
    # sines and cosines included) for every key of the product-sum below.
    q = inductor_realize(query.float().reshape(b, kv, g, 1, d))
    k = key.float().unsqueeze(2)  # [B, KV, 1, L, D]
    v = value.float().unsqueeze(2)
    s = (q * k).sum(-1) * sc  # [B, KV, G, L]
    if attn_mask is not None:
        m = attn_mask.float().expand(b, h, 1, length).reshape(b, kv, g, length)
        s = s + m
    mx = s.amax(-1, keepdim=True)
    mx = torch.where(mx == float("-inf"), torch.zeros_like(mx), mx)
    e = torch.exp(s - mx)  # a fully masked row: all zeros
    den = e.sum(-1, keepdim=True)
    den = torch.where(den == 0, torch.ones_like(den), den)
    out = (e.unsqueeze(-1) * v).sum(-2) / den  # [B, KV, G, D]
    out = out.reshape(b, h, 1, d).to(dtype)
    return out, query.new_empty((b, h, 1), dtype=torch.float32)


def _shapes(node: fx.Node) -> tuple[Any, Any, Any, Any] | None:
    """``(query, key, value, mask)`` values of a CPU flash attention a one-query rewrite
    may take (inference, no dropout, not causal, one query position, whole groups of
    query heads per key/value head), else None."""
    if not only_output_used(node):
        return None  # the log-sum-exp (or the whole tuple) is used: a training forward
    dropout = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
    causal = node.args[4] if len(node.args) > 4 else node.kwargs.get("is_causal", False)
    if dropout != 0.0 or causal:
        return None
    q, k, v = (node_val(a) for a in node.args[:3])
    mask = node.kwargs.get("attn_mask")
    m = node_val(mask) if isinstance(mask, fx.Node) else None
    vals = [q, k, v] + ([m] if isinstance(mask, fx.Node) else [])
    if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in vals):
        return None
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.dtype not in _DTYPES:
        return None
    if not (isinstance(q.shape[2], int) and q.shape[2] == 1):
        return None
    heads, kv = q.shape[1], k.shape[1]
    if not (isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv == 0):
        return None
    if not (known_equal(k.shape, v.shape) and known_equal(q.shape[3], k.shape[3])):
        return None
    return q, k, v, m


def _fits(node: fx.Node) -> bool:
    found = _shapes(node)
    if found is None:
        return False
    q, k, _, _ = found
    macs = q.shape[0] * q.shape[1] * k.shape[2] * q.shape[3]
    return isinstance(macs, int) and macs <= MAX_MACS


def _kernel_fits(node: fx.Node) -> bool:
    """Whether graphgear's kernel (:mod:`graphgear.cpu.kernels.decode_attention_kernel`) takes this
    attention: float32 throughout, a static head dim, and a mask it reads (none, or
    ``[1 or B, 1 or H, 1, L]`` bool or float32, also float32 values)."""
    found = _shapes(node)
    if found is None:
        return False
    q, k, v, m = found
    if not (q.dtype == k.dtype == v.dtype == torch.float32 and isinstance(q.shape[3], int)):
        return False
    if m is None and node.kwargs.get("attn_mask") is not None:
        return False
    return attention_kernel.mask_fits(m, q.shape[0], q.shape[1], k.shape[2])


def _use_kernel(gm: fx.GraphModule, node: fx.Node) -> None:
    """Replace the flash attention ``node`` (only its output used) by
    ``graphgear::decode_attention``."""
    q, k, v = node.args[:3]
    qv = node_val(q)
    scale = node.kwargs.get("scale")
    if scale is None:
        scale = attention_kernel.default_scale(qv.shape[3])
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(torch.ops.graphgear.decode_attention.default,
                                     (q, k, v, node.kwargs.get("attn_mask"), float(scale)))
    new.meta = {k_: v_ for k_, v_ in node.meta.items() if k_ != "val"}
    new.meta["val"] = qv.new_empty(qv.shape)  # contiguous, as the kernel writes it
    for user in list(node.users):
        user.replace_all_uses_with(new)
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)


class DecodeAttention(GraphPass):
    """See the module docstring."""

    inside_regions = True

    name = "decode_attention"
    static_sizes = True  # MAX_MACS: a dynamic batch is decided per gear

    def enabled(self, config: Any) -> bool:
        return mode_of(config) in ("max-autotune", "reduce-overhead")

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
        target = cpu_flash_attention()
        if target is None or is_split_op(config, target):
            return 0  # (a split op of piecewise capture runs as it is)
        # a graph re-traced for one gear has a getitem for every output of the tuple,
        # used or not: drop the unused ones (pure) so "only the output is used" can hold
        for n in list(gm.graph.find_nodes(op="call_function", target=operator.getitem)):
            if not n.users and isinstance(n.args[0], fx.Node) and n.args[0].target is target:
                gm.graph.erase_node(n)
        count = 0
        kernel_nodes = [n for n in gm.graph.find_nodes(op="call_function", target=target) if _kernel_fits(n)]
        if kernel_nodes and attention_kernel.kernel() is not None:  # lowered by compilers/inductor
            for n in kernel_nodes:
                _use_kernel(gm, n)
            gm.recompile()
            count = len(kernel_nodes)
        table = inductor_decomp_table() if decomp_kind(config) == "inductor" else None
        return count + inline_decompositions(gm, {target: decode_attention}, select=_fits, decompositions=table)

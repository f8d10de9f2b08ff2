"""Fold ``repeat_kv`` into the CPU attention kernel: grouped-query attention without
materialising the repeated keys and values.

Llama-, Qwen2- and Mistral-style models in transformers expand their key/value heads to
the query heads before calling SDPA (``repeat_kv``: ``unsqueeze(2)`` + ``expand`` +
``reshape``). In the aten graph that is ``_unsafe_view(clone(expand(unsqueeze(kv, 2))))``:
a copy of the whole KV cache, per layer and step, which at a decode step is most of the
attention's memory traffic (batch 8, 64 positions, 2 of 4 heads: 512 KB written per
tensor per layer to read 4 KB of new keys). ATen's CPU flash-attention kernel
(``_scaled_dot_product_flash_attention_for_cpu``) takes fewer key/value heads than query
heads itself (query head ``h`` reads key/value head ``h // r``, the order ``repeat_kv``
builds; it is what ``scaled_dot_product_attention(..., enable_gqa=True)`` lowers to on
the CPU), so the pass hands it the unexpanded tensors.

It rewrites a CPU flash attention whose key and value are both ``repeat_kv`` of tensors
with the same heads and whose log-sum-exp output is unused (inference graphs; a training
forward saves it for the backward, which reads the expanded tensors: left alone).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from ..shapes import known_equal
from .manager import GraphPass, node_val

aten = torch.ops.aten

__all__ = ["FoldRepeatKV", "cpu_flash_attention", "only_output_used"]

_RESHAPES = {aten._unsafe_view.default, aten.view.default, aten.reshape.default}


def cpu_flash_attention() -> Any:
    """ATen's CPU flash-attention overload, None where this torch has none."""
    packet = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    return packet.default if packet is not None else None


def only_output_used(node: fx.Node) -> bool:
    """Whether a CPU flash attention call's log-sum-exp is unused (only ``node[0]`` is
    read: inference; a training forward saves the log-sum-exp for the backward)."""
    return len(node.args) >= 3 and all(u.target is operator.getitem and u.args[1] == 0 for u in node.users)


def _repeated_source(node: Any) -> tuple[fx.Node, int] | None:
    """``(kv, r)`` when ``node`` is ``repeat_kv(kv, r)`` with ``r > 1``: ``kv`` is
    ``[B, KV, L, D]`` and ``node`` ``[B, KV * r, L, D]``."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _RESHAPES:
        return None
    clone = node.args[0]
    if isinstance(clone, fx.Node) and clone.op == "call_function" and clone.target is aten.clone.default:
        expand = clone.args[0]
    else:
        expand = clone
    if not (isinstance(expand, fx.Node) and expand.op == "call_function" and expand.target is aten.expand.default):
        return None
    unsq = expand.args[0]
    if not (isinstance(unsq, fx.Node) and unsq.op == "call_function" and unsq.target is aten.unsqueeze.default
            and unsq.args[1] == 2 and isinstance(unsq.args[0], fx.Node)):
        return None
    src, out, wide = unsq.args[0], node_val(node), node_val(expand)
    kv = node_val(src)
    if not all(isinstance(t, torch.Tensor) for t in (kv, out, wide)) or kv.dim() != 4 or wide.dim() != 5:
        return None
    b, heads, length, dim = kv.shape
    r = wide.shape[2]
    if not isinstance(r, int) or r < 2:
        return None
    # sizes may be symbolic (a dynamic batch or length): compared without adding guards
    if not known_equal(wide.shape, (b, heads, r, length, dim)) or \
            not known_equal(out.shape, (b, heads * r, length, dim)):
        return None
    return src, r


class FoldRepeatKV(GraphPass):
    """See the module docstring."""

    inside_regions = True

    name = "fold_repeat_kv"

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
        target = cpu_flash_attention()
        if target is None:
            return 0
        changed = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=target)):
            if not only_output_used(node):
                continue  # the log-sum-exp (or the whole tuple) is used: a training forward
            k, v = _repeated_source(node.args[1]), _repeated_source(node.args[2])
            if k is None or v is None or k[1] != v[1]:
                continue
            kv_k, kv_v = node_val(k[0]), node_val(v[0])
            if not known_equal(kv_k.shape[1], kv_v.shape[1]) or kv_k.device.type != "cpu":
                continue
            node.args = (node.args[0], k[0], v[0], *node.args[3:])
            changed += 1
        if changed:
            gm.graph.eliminate_dead_code()
        return changed

"""View-to-reshape: ``aten.view`` whose input now comes from a fused op becomes
``aten.reshape``.

A traced ``view`` was valid for the strides the unfused ops produced; a fused op
(``scaled_dot_product_attention``, ``_fused_rms_norm``, ``graphgear::*``) may return
other strides, where ``view`` would fail. ``reshape`` views when it can and copies when
it must. Views of unfused producers are left alone (``reshape`` dispatches slower).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from .._torch.ops import OpOverload
from .manager import GraphPass

aten = torch.ops.aten

__all__ = ["ViewToReshape"]

_PASS_THROUGH = {aten.view.default, aten.permute.default, aten.transpose.int, aten.expand.default,
                 aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim,
                 aten.alias.default, aten.t.default, operator.getitem}


def _fused_targets() -> set[Any]:
    out = {aten.scaled_dot_product_attention.default, aten._fused_rms_norm.default}
    for name in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
        packet = getattr(aten, name, None)
        if packet is not None:
            out.add(packet.default)
    return out


def _origin(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _PASS_THROUGH and node.args \
            and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


class ViewToReshape(GraphPass):

    inside_regions = True
    name = "view_to_reshape"

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
        fused = _fused_targets()
        changed = 0
        for node in list(gm.graph.find_nodes(op="call_function", target=aten.view.default)):
            src = node.args[0]
            if not isinstance(src, fx.Node):
                continue
            origin = _origin(src)
            if origin.op == "call_function" and (
                origin.target in fused
                or (isinstance(origin.target, OpOverload) and origin.target.namespace == "graphgear")
            ):
                node.target = aten.reshape.default
                changed += 1
        return changed

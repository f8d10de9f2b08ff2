"""``remove_cat_ops``: the inputs of a ``cat`` written straight into one preallocated output.

``cat([a, b], dim)`` of tensors the graph computes allocates ``a`` and ``b``, then a third
tensor, and copies both into it. This pass allocates the output first
(``empty_strided`` with the cat's sizes and strides) and makes each producer write its
slice of it through the op's ``out=`` variant, so the copies and the inputs' own memory
disappear. An input that cannot be written in place (a graph input, an op with no
``out=`` variant, a tensor something else also reads, a dtype the cat converts) is copied
into its slice instead; a cat with no input of the first kind is left alone.

It runs only where the graph runs as it is (``debug.run_eagerly``, and device graphs that
capture the FX graph rather than Inductor's code: CUDA without Triton, the NPU): Inductor
already plans a cat's inputs into one buffer (its concat kernel), and gets ``out=`` ops
only as opaque fallbacks. TorchAir does the same on its NPU graphs (``remove_cat_ops``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from .._torch.ops import OpOverload, op_schema
from ..capture import DEVICE_KINDS
from ..capture.rules import graph_device
from ..config import mode_of
from .manager import GraphPass, node_val

aten = torch.ops.aten

__all__ = ["RemoveCatOps", "out_variant", "runs_as_is"]


def runs_as_is(config: Any, example_inputs: Sequence[Any]) -> bool:
    """True when the mode runs the FX graph itself (no Inductor): ``run_eagerly``, or
    reduce-overhead on a device whose graphs capture the FX graph (``DeviceKind.native``)."""
    mode = mode_of(config)
    if mode == "eager":
        return True
    if mode != "reduce-overhead":
        return False
    kind = DEVICE_KINDS.get(graph_device(example_inputs).type)
    return kind is not None and not kind.native()


def _signature(op: OpOverload) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in op_schema(op).arguments if a.name != "out"]


def out_variant(target: Any) -> OpOverload | None:
    """The overload of ``target``'s op that takes the same arguments plus ``out=`` (one
    tensor output), or None."""
    if not isinstance(target, OpOverload) or target.namespace != "aten":
        return None
    schema = op_schema(target)
    if len(schema.returns) != 1 or any(a.alias_info is not None for a in schema.arguments):
        return None  # several outputs, or the op writes or views an argument
    packet, want = target.overloadpacket, _signature(target)
    for name in packet.overloads():
        op = getattr(packet, name)
        args = op_schema(op).arguments
        outs = [a for a in args if a.name == "out"]
        if len(outs) == 1 and outs[0].kwarg_only and _signature(op) == want:
            return op  # type: ignore[no-any-return]
    return None


def _static_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class RemoveCatOps(GraphPass):
    name = "remove_cat_ops"

    def enabled(self, config: Any) -> bool:
        return bool(config.experimental_config.remove_cat_ops)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
        if not runs_as_is(config, example_inputs):
            return 0
        changed = 0
        for cat in list(gm.graph.find_nodes(op="call_function", target=aten.cat.default)):
            changed += self._rewrite(gm.graph, cat)
        if changed:
            gm.graph.eliminate_dead_code()
        return changed

    @staticmethod
    def _rewrite(graph: fx.Graph, cat: fx.Node) -> int:
        tensors = cat.args[0]
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        out = node_val(cat)
        if not isinstance(tensors, list | tuple) or len(tensors) < 2 or not isinstance(out, torch.Tensor) \
                or not _static_int(dim) or not all(isinstance(t, fx.Node) for t in tensors):
            return 0
        dim = dim % out.dim() if out.dim() else 0
        vals = [node_val(t) for t in tensors]
        if not all(isinstance(v, torch.Tensor) and v.dim() == out.dim() for v in vals) \
                or not all(_static_int(s) for s in out.shape) or not all(_static_int(s) for s in out.stride()):
            return 0  # a legacy empty 1-D input, or symbolic sizes: left as it is
        direct = [t.op == "call_function" and len(t.users) == 1 and tensors.count(t) == 1
                  and v.dtype == out.dtype and v.device == out.device and out_variant(t.target) is not None
                  and "out" not in t.kwargs for t, v in zip(tensors, vals)]
        if not any(direct):
            return 0
        order = {n: i for i, n in enumerate(graph.nodes)}
        first = min((t for t, d in zip(tensors, direct) if d), key=lambda n: order[n])
        with graph.inserting_before(first):
            buf = graph.call_function(aten.empty_strided.default, (list(out.shape), list(out.stride())),
                                      {"dtype": out.dtype, "device": out.device})
        buf.meta["val"] = out
        offset = 0
        for t, v, d in zip(tensors, vals, direct):
            size = int(v.shape[dim])
            with graph.inserting_before(t if d else cat):
                piece = graph.call_function(aten.slice.Tensor, (buf, dim, offset, offset + size))
                piece.meta["val"] = out.narrow(dim, offset, size)
                if not d:
                    graph.call_function(aten.copy_.default, (piece, t)).meta["val"] = piece.meta["val"]
            if d:  # in place: the producer keeps its name (data dumps match by name)
                t.target, t.kwargs = out_variant(t.target), {**t.kwargs, "out": piece}
            offset += size
        cat.replace_all_uses_with(buf)
        graph.erase_node(cat)
        return 1

"""ATen operators: ``OpOverload`` / ``OpOverloadPacket`` (``torch._ops``), their private
attributes (``_schema``, ``_opname``, ``_overloadname``, ``_qualified_op_name``), the
dispatcher's kernel registry (``torch._C._dispatch_*``) and torch's decompositions of the
fused RMSNorm ops (``torch._decomp``).

Checked on 2.13 (CPU build) and 2.14.1; every FX graph traced by make_fx/AOTAutograd
has these ops as call targets (2.11 to 2.14). If they moved, graphgear could not tell
aten calls from other callables (op summaries, mutated-input detection, in-place
recovery, the aten-graph check) or decide where the RMSNorm fusion pays; each wrapper
has its note. ATen's underscored ops (``aten._fused_rms_norm``) are public op names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# torch._ops.OpOverload / OpOverloadPacket / HigherOrderOperator: checked on 2.13; every FX graph traced by
# make_fx/AOTAutograd has them as call targets (2.11 to 2.14). If they moved, graphgear
# could not tell aten calls from other callables (op summaries, mutated-input detection,
# in-place recovery, the aten-graph check, which nodes a repeated region may hold).
# ``import torch`` already imports the module.
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket

__all__ = [
    "HigherOrderOperator",
    "OpOverload",
    "OpOverloadPacket",
    "all_op_names",
    "auto_functionalized_in_place",
    "auto_functionalized_op",
    "auto_functionalized_writes",
    "decomp_fused_rms_norm",
    "decomp_fused_rms_norm_backward",
    "has_kernel_for_dispatch_key",
    "op_name",
    "op_overload_name",
    "op_packet_name",
    "op_schema",
]


def op_schema(op: OpOverload) -> Any:
    """``op._schema`` (its ``FunctionSchema``: arguments, alias info). Checked on 2.13;
    used by torch's own ``torch._library``/functionalization. Without it graphgear cannot
    tell which arguments an op writes (KV caches) or recover in-place ops."""
    return op._schema


def op_name(op: OpOverload) -> str:
    """``aten.add`` for ``aten.add.Tensor`` (``namespace`` + ``_opname``; checked on 2.13).
    Names ops in ``stats()`` fallbacks and the op summary."""
    return f"{op.namespace}.{op._opname}"


def op_overload_name(op: OpOverload) -> str:
    """``Tensor`` for ``aten.add.Tensor`` (``_overloadname``; checked on 2.13)."""
    return op._overloadname


def op_packet_name(packet: OpOverloadPacket) -> str:
    """``aten.add`` for the packet ``aten.add`` (``_qualified_op_name``; checked on 2.13)."""
    return packet._qualified_op_name.replace("::", ".")


def has_kernel_for_dispatch_key(op_name: str, key: str) -> bool:
    """Whether the operator ``op_name`` (``"aten::_fused_rms_norm"``) has a kernel of its
    own registered for dispatch key ``key`` (``"CPU"``, ``"CUDA"``).

    ``torch._C._dispatch_has_kernel_for_dispatch_key``: checked on 2.13; used by torch's
    own ``torch._meta_registrations`` and ``torch._library`` in 2.13. If it went, the RMSNorm
    fusion could not tell where the fused op is worth it."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op_name, key)


def decomp_fused_rms_norm(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
                          eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten._fused_rms_norm`` written with aten ops.

    ``torch._decomp.decompositions._fused_rms_norm``: checked on 2.13 (torch registers it
    as the op's decomposition). If it went, Inductor would call the fused RMSNorm as an
    extern kernel instead of fusing it with its neighbours."""
    from torch._decomp.decompositions import _fused_rms_norm

    return _fused_rms_norm(x, normalized_shape, weight, eps)


def decomp_fused_rms_norm_backward() -> Callable[..., Any]:
    """``aten._fused_rms_norm_backward`` written with aten ops (the function itself).

    ``torch._decomp.decompositions._fused_rms_norm_backward``: checked on 2.13 (torch
    registers it as the op's decomposition). If it went, as :func:`decomp_fused_rms_norm`,
    for the backward."""
    from torch._decomp.decompositions import _fused_rms_norm_backward

    return _fused_rms_norm_backward


def all_op_names() -> list[str]:
    """Every operator the dispatcher knows now, ``namespace::name`` (``"aten::mm"``,
    ``"mylib::paged_attention"``; overload names left out), custom ops of
    ``torch.library`` included once they are registered.

    ``torch._C._dispatch_get_all_op_names``: checked on 2.13 (also in 2.11); torch's own
    ``torch._library`` test utilities list ops with it. If it went, ``split_ops`` names
    could not be checked against the known ops (they would be taken as written)."""
    names = torch._C._dispatch_get_all_op_names()
    return sorted({n.split(".")[0] for n in names})


# torch._higher_order_ops.auto_functionalize: checked on 2.13; the names and the
# ``_only_clone_these_bases`` / ``_only_clone_these_tensors`` keywords of its dense
# implementations are also in 2.11 (Inductor's reinplace pass calls them so). A
# ``torch.library`` op that writes an input (``mutates_args=("cache",)``) is held in an
# AOT graph as ``auto_functionalized_v2(op, ...)`` (``auto_functionalized`` with
# Inductor's ``enable_auto_functionalized_v2`` off): the op runs on clones of what it
# writes and the new values are copied back at the end of the graph. Without these,
# ``split_ops`` could not name such an op (its node's target is the wrapper), and a split
# node of one would write clones (right, but a copy of the whole buffer per call).
try:
    from torch._higher_order_ops.auto_functionalize import (
        auto_functionalized,
        auto_functionalized_dense,
        auto_functionalized_v2,
        auto_functionalized_v2_dense,
        get_mutable_args,
    )
except ImportError:  # pragma: no cover - a torch without them: no see-through
    auto_functionalized = auto_functionalized_v2 = None


def auto_functionalized_op(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpOverload | None:
    """The op an ``auto_functionalized(_v2)`` call of an FX node runs (its ``_mutable_op``,
    the first argument), or None where ``target`` is no such wrapper."""
    if target is None or target not in (auto_functionalized, auto_functionalized_v2):
        return None
    op = args[0] if args else kwargs.get("_mutable_op")
    return op if isinstance(op, OpOverload) else None


def _results(op: OpOverload) -> int:
    """How many items an op's own result takes at the front of the wrapper's tuple."""
    returns = op_schema(op).returns
    return len(returns) if len(returns) > 1 else 1


def auto_functionalized_writes(target: Any, args: tuple[Any, ...],
                               kwargs: dict[str, Any]) -> list[tuple[int, Any]] | None:
    """What an ``auto_functionalized(_v2)`` call writes: ``(index, original)`` per tensor,
    where ``index`` is the place of its new value in the call's result and ``original``
    the argument holding the tensor written (a base of ``_all_bases``, or the mutable
    argument). None where it is no such call, or one :func:`auto_functionalized_in_place`
    cannot run in place (an ``out=`` op, a list of tensors written)."""
    op = auto_functionalized_op(target, args, kwargs)
    if op is None:
        return None
    first = _results(op)
    if target is auto_functionalized_v2:
        if torch._library.utils.is_out(op):
            return None
        return [(first + i, b) for i, b in enumerate(kwargs.get("_all_bases", []))]
    names, _ = get_mutable_args(op)
    values = [kwargs.get(name) for name in names]
    if any(v is None or isinstance(v, list | tuple) for v in values):
        return None
    return [(first + i, v) for i, v in enumerate(values)]


def _v1_in_place(_mutable_op: OpOverload, **kwargs: Any) -> Any:
    """``auto_functionalized`` run on the tensors themselves (no clone): returns them."""
    return auto_functionalized_dense(_mutable_op, _only_clone_these_tensors=(), **kwargs)


def _v2_in_place(_mutable_op: OpOverload, **kwargs: Any) -> Any:
    """``auto_functionalized_v2`` run on the bases themselves (no clone): returns them."""
    return auto_functionalized_v2_dense(_mutable_op, _only_clone_these_bases=(), **kwargs)


def auto_functionalized_in_place(target: Any) -> Callable[..., Any]:
    """A call target that does what ``target`` (``auto_functionalized(_v2)``, one that
    :func:`auto_functionalized_writes` accepts) does, but
    writes the tensors themselves instead of clones and returns them in the places of
    the new values (:func:`auto_functionalized_writes`)."""
    return _v2_in_place if target is auto_functionalized_v2 else _v1_in_place

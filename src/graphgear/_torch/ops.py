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

# torch._ops.OpOverload / OpOverloadPacket: checked on 2.13; every FX graph traced by
# make_fx/AOTAutograd has them as call targets (2.11 to 2.14). If they moved, graphgear
# could not tell aten calls from other callables (op summaries, mutated-input detection,
# in-place recovery, the aten-graph check). ``import torch`` already imports the module.
from torch._ops import OpOverload, OpOverloadPacket

__all__ = [
    "OpOverload",
    "OpOverloadPacket",
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

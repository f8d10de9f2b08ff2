"""One compiler per mode, each ``compiler(gm, example_inputs, ctx) -> callable`` on one
aten-level graph (static when the pipeline dispatches by shape):

* ``eager`` (``debug.run_eagerly``): the FX graph as it is (:mod:`.eager`);
* ``max-autotune``: Inductor's whole-graph compile (:mod:`.inductor`, which owns every
  Inductor call);
* ``reduce-overhead``: a capture engine per graph key (:mod:`.reduce_overhead`).

:data:`MODE_COMPILERS` maps a mode to a factory called once per graph with its compile
context; what it returns is called once per static graph (graph key) with that key's
context (``ctx.for_key``). Per-graph state (the reduce-overhead capture group) lives in
that object, never in the context.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from torch import fx

from .._torch.inductor import inductor_lowering
from .._torch.ops import OpOverload
from ..capture.rules import UNCAPTURABLE
from ..context import CompileContext
from ..debug import op_key
from .eager import compile_eager
from .inductor import compile_inductor
from .reduce_overhead import ReduceOverheadCompiler

__all__ = ["MODE_COMPILERS", "ModeCompiler", "ReduceOverheadCompiler", "compile_eager", "compile_inductor",
           "op_support"]

#: ``compiler(gm, example_inputs, ctx)``: the compiled callable of one graph (``ctx.key``
#: names its graph key, recorded in ``ctx.artifacts`` by the compile cache; ``ctx.loaded``
#: that key's stored code, used instead of compiling)
ModeCompiler = Callable[[fx.GraphModule, Sequence[Any], CompileContext], Callable[..., Any]]


def _stateless(compiler: ModeCompiler) -> Callable[[CompileContext], ModeCompiler]:
    return lambda ctx: compiler


MODE_COMPILERS: Mapping[str, Callable[[CompileContext], ModeCompiler]] = MappingProxyType({
    "eager": _stateless(compile_eager),
    "max-autotune": _stateless(compile_inductor),
    "reduce-overhead": ReduceOverheadCompiler,
})


def op_support(target: object, mode: str) -> tuple[bool, str]:
    """Whether ``mode`` handles ``target`` natively, and why not."""
    key = op_key(target)
    if mode == "reduce-overhead" and key in UNCAPTURABLE:
        return False, UNCAPTURABLE[key]
    if mode == "max-autotune" and isinstance(target, OpOverload):
        lowering = inductor_lowering()
        if target in lowering.lowerings or target.overloadpacket in lowering.lowerings:
            return True, "lowered by Inductor"
        if target in lowering.fallbacks or target.overloadpacket in getattr(lowering, "fallbacks", ()):
            return True, "Inductor calls the ATen kernel (fallback)"
        return False, "no Inductor lowering: runs as an ATen fallback"
    return True, ""

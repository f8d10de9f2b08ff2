"""One compiler per mode, each ``compiler(gm, example_inputs, ctx) -> callable`` on one
aten-level graph (static when the pipeline dispatches by shape):

* ``eager`` (``debug.run_eagerly``): the FX graph as it is (:mod:`.eager`);
* ``max-autotune``: Inductor's whole-graph compile (:mod:`.inductor`, which owns every
  Inductor call);
* ``reduce-overhead``: a capture engine per graph (:mod:`.reduce_overhead`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._torch.inductor import inductor_lowering
from .._torch.ops import OpOverload
from ..capture.rules import UNCAPTURABLE
from ..debug import op_key
from .eager import compile_eager
from .inductor import compile_inductor
from .reduce_overhead import compile_reduce_overhead

__all__ = ["MODE_COMPILERS", "ModeCompiler", "compile_eager", "compile_inductor",
           "compile_reduce_overhead", "op_support"]

#: ``compiler(gm, example_inputs, ctx, key=None, loaded=None)``: ``key`` is the graph key
#: of a static graph (recorded in ``ctx.artifacts`` by the compile cache), ``loaded`` that
#: key's stored code (``artifacts.KeyArtifact``), used instead of compiling
ModeCompiler = Callable[..., Callable[..., Any]]

MODE_COMPILERS: dict[str, ModeCompiler] = {
    "eager": compile_eager,
    "max-autotune": compile_inductor,
    "reduce-overhead": compile_reduce_overhead,
}


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

"""``debug.run_eagerly``: run the optimised FX graph as it is, op by op."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from ..context import CompileContext


def compile_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext) -> Callable[..., Any]:
    """The graph module itself: no capture, no code generation (nothing per key to
    store or load)."""
    return gm.forward

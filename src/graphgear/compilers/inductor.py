"""``max-autotune``: hand the whole graph to Inductor."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from .base import CompileContext

log = logging.getLogger(__name__)


def inductor_decompositions() -> dict[Any, Any]:
    """Inductor's own decomposition table (it leaves out the entries that break
    attention gradients on the CPU)."""
    from torch._inductor.decomposition import select_decomp_table

    return dict(select_decomp_table())


def compile_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext) -> Callable[..., Any]:
    """Compile ``gm`` with Inductor's graph compiler; returns Inductor's boxed callable."""
    from torch._inductor.compile_fx import compile_fx_inner

    compiled = compile_fx_inner(
        gm,
        list(example_inputs),
        static_input_idxs=list(ctx.static_inputs),
        is_inference=ctx.stage == "inference",
        is_backward=ctx.stage == "backward",
    )
    return compiled

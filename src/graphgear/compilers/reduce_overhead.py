"""``mode="reduce-overhead"``: capture each static graph into a device graph and replay it.

:class:`ReduceOverheadCompiler` is the mode compiler of one FX graph (the pipeline makes
one per graph and calls it once per graph key with a static graph). For each key it
checks what the device graph cannot hold (``capture_config.fallback``), compiles the
graph's native code with Inductor (:func:`graphgear.compilers.inductor.compile_static`),
or takes the compile cache's stored code, and only then makes the
:class:`~graphgear.capture.engine.CaptureEngine` that warms up, captures on first use and
replays that code. The engines of one graph share its capture group (pool, capture
count) and, with ``frozen_parameter``, the copies of its frozen weights.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from ..capture import (
    CaptureEngine,
    CaptureGroup,
    Executor,
    UncapturedGraph,
    device_kind,
    find_uncapturable,
    graph_device,
)
from ..capture.entry import InputRoles
from ..capture.rules import warn
from ..context import CompileContext
from ..cpu import kernels
from ..cpu.frozen import FrozenCopies
from ..errors import CaptureError
from .executors import FrozenExecutor, native_code
from .inductor import compile_static

log = logging.getLogger(__name__)

__all__ = ["ReduceOverheadCompiler"]


class ReduceOverheadCompiler:
    """The reduce-overhead compiler of one FX graph (see the module docstring)."""

    def __init__(self, ctx: CompileContext) -> None:
        self.group = CaptureGroup.for_graph(ctx.record.name)
        # the copies of frozen weights: the backend's (shared by its graphs), else this graph's
        self.copies = ctx.frozen_copies if ctx.frozen_copies is not None else FrozenCopies()

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext) -> Callable[..., Any]:
        """A boxed callable that captures and replays ``gm``, or (``fallback="eager"``)
        runs a graph that cannot be captured as it is.

        ``ctx.loaded`` (the compile cache): the key's Inductor code, stored by a first
        process that captured it; the engine captures that code (no decomposition, no
        Inductor compile) and ``gm`` (then possibly the dynamic graph) only runs its
        warm-up. With ``ctx.artifacts`` and ``ctx.key``, the code compiled here is
        recorded there."""
        device = graph_device(example_inputs)
        blocked = find_uncapturable(gm, device) if ctx.loaded is None else []
        if blocked:
            return _uncapturable(gm, ctx, device, blocked)
        kind = device_kind(device, ctx.record.name)
        engine = functools.partial(CaptureEngine, gm, example_inputs, ctx, kind=kind, device=device,
                                   group=self.group)
        if ctx.loaded is not None:
            kernels.register_lowerings()  # the stored code may call graphgear's kernels
            return engine(executor=Executor(kind.code(ctx.loaded.code, gm, ctx.record.name)),
                          native_warmup=True)
        roles = InputRoles.of(example_inputs, stage=ctx.stage, static_inputs=ctx.static_inputs,
                              mutated_inputs=ctx.mutated_inputs,
                              clone_input=ctx.config.capture_config.clone_input)
        code = functools.partial(native_code, gm=gm, kind=kind, stage=ctx.stage, static_idx=roles.static,
                                 name=ctx.record.name)
        # frozen_parameter on an inference graph: weights become constants, packed for the
        # C++ GEMM template (small-M matrix products at batch 2 to 8); the CPU graph only.
        # The code holds the weights' values: made per set of weights, on its first capture
        if ctx.config.experimental_config.frozen_parameter and ctx.stage == "inference" and device.type == "cpu":
            frozen = functools.partial(compile_static, frozen=True, copies=self.copies, config=ctx.config,
                                       record=ctx.record)
            return engine(executor=FrozenExecutor(
                lambda args: kind.code(code(frozen, args=args), gm, ctx.record.name)))
        compiled = code(functools.partial(compile_static, config=ctx.config, record=ctx.record),
                        args=roles.as_bound(example_inputs))
        if compiled is not None and ctx.artifacts is not None and ctx.key is not None:
            ctx.artifacts.record(ctx.key, "static", compiled)
        return engine(executor=Executor(kind.code(compiled, gm, ctx.record.name)))


def _uncapturable(gm: fx.GraphModule, ctx: CompileContext, device: Any,
                  blocked: list[tuple[str, str]]) -> Callable[..., Any]:
    """A graph with ops its device graph cannot hold: ``fallback='raise'`` raises, else it
    runs as it is, with one warning."""
    for op, reason in blocked:
        ctx.record.add_fallback(op, reason)
    listing = "; ".join(f"{op}: {reason}" for op, reason in blocked)
    if ctx.config.capture_config.fallback == "raise":
        raise CaptureError(
            f"graphgear: {ctx.record.name} ({ctx.stage}) cannot be captured into a "
            f"{device.type} graph: {listing}. capture_config.fallback='raise' forbids running "
            f"it uncaptured; set fallback='eager', or move the op out of the compiled region."
        )
    warn(
        f"graphgear: {ctx.record.name} ({ctx.stage}) cannot be captured into a {device.type} "
        f"graph ({listing}); it runs uncaptured (fallback='eager'). Move the op out of the "
        f"compiled region to capture the rest, or set fallback='raise' to make this an error."
    )
    return UncapturedGraph(gm, ctx.record)

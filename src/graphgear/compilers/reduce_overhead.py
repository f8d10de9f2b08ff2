"""``mode="reduce-overhead"``: capture each static graph into a device graph and replay it.

:func:`compile_reduce_overhead` is the mode compiler (the pipeline calls it once per
graph key with a static graph). It checks what the device graph cannot hold
(``capture_config.fallback``), then returns a
:class:`~graphgear.capture.engine.CaptureEngine`, which warms up, captures on first
use, and replays; the engine compiles the graph's native code with Inductor
(:func:`graphgear.compilers.inductor.compile_static`) once, on its first capture.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from ..artifacts import KeyArtifact
from ..capture import CaptureEngine, UncapturedGraph, find_uncapturable, graph_device
from ..capture.rules import warn
from ..context import CompileContext
from ..cpu import kernels
from ..cpu.frozen import FrozenCopies
from ..errors import CaptureError
from .inductor import compile_static

log = logging.getLogger(__name__)

__all__ = ["compile_reduce_overhead"]


def compile_reduce_overhead(
    gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext,
    key: tuple[int, ...] | None = None, loaded: KeyArtifact | None = None,
) -> Callable[..., Any]:
    """The reduce-overhead compiler of one static graph: a boxed callable that captures
    and replays, or (``fallback="eager"``) runs a graph that cannot be captured as it is.

    ``loaded`` (the compile cache): the key's Inductor code, stored by a first process
    that captured it; the engine captures that code (no decomposition, no Inductor
    compile) and ``gm`` (then possibly the dynamic graph) only runs its warm-up. With
    ``ctx.artifacts`` and a ``key``, the code compiled at capture is recorded there."""
    device = graph_device(example_inputs)
    if loaded is not None:
        code = loaded.code
        kernels.register_lowerings()  # the stored code may call graphgear's kernels
        return CaptureEngine(gm, example_inputs, ctx, device,
                             compile_static=lambda *args, **kwargs: code, native_warmup=True)
    blocked = find_uncapturable(gm, device)
    if blocked:
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
    # frozen_parameter on an inference graph: weights become constants, packed for the C++
    # GEMM template (small-M matrix products at batch 2 to 8); the CPU graph only
    frozen = (ctx.config.experimental_config.frozen_parameter and ctx.stage == "inference"
              and device.type == "cpu")
    if frozen and ctx.frozen_copies is None:
        ctx.frozen_copies = FrozenCopies()
    native: Callable[..., Any] = functools.partial(compile_static, frozen=frozen,
                                                   copies=ctx.frozen_copies if frozen else None,
                                                   config=ctx.config, record=ctx.record)
    if ctx.artifacts is not None and key is not None and not frozen:  # frozen code holds the weights
        native = ctx.artifacts.recording(key, native)
    return CaptureEngine(gm, example_inputs, ctx, device, compile_static=native, frozen=frozen)

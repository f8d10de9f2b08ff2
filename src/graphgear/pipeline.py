"""The pipeline every aten-level graph goes through (:func:`compile_graph`): stats
record → dump → FX passes → dump and op summary → dispatch by shape (one static graph
per gear or graph key, :class:`~graphgear.gears.GearedGraph`) → the mode's compiler
(``graphgear.compilers``)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import fx

from . import debug
from ._torch import make_boxed_func
from .compilers import MODE_COMPILERS, op_support
from .config import mode_of
from .context import CompileContext
from .dispatch import GearedGraph, output_specs, unsliceable_outputs
from .gears import GearPlan
from .inputs import aot_input_names, mutated_placeholders, static_input_indices
from .passes import post_grad_pass_manager
from .shapes import ShapeInfo, specialize
from .stats import new_record

if TYPE_CHECKING:
    from .config import CompilerConfig

log = logging.getLogger(__name__)

__all__ = ["compile_graph"]

def compile_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    config: CompilerConfig,
    stage: str,
    input_names: Sequence[str] | None = None,
    static_inputs: Sequence[int] | None = None,
    boxed: bool = False,
) -> Callable[..., Any]:
    """Run graphgear's passes on an aten-level graph and compile it in the config's mode.

    Returns ``fn(*args)``, or with ``boxed=True`` AOTAutograd's boxed convention
    ``fn(list_of_args)`` (which lets the callee free inputs early).
    """
    mode = mode_of(config)
    record = new_record(stage, mode)
    t0 = time.perf_counter()
    placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    names = placeholders
    if input_names is not None and stage != "backward":
        # the user's names, where AOTAutograd's placeholders hold dynamo's inputs
        names = aot_input_names(gm, input_names)
    record.inputs = names
    debug.dump_graph(gm, config, record.name, stage)
    post_grad_pass_manager(config).run(gm, example_inputs, config, record)
    debug.dump_graph(gm, config, record.name, "final")
    debug.fx_summary(gm, config, record.name, functools.partial(op_support, mode=mode))
    record.num_nodes = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    static = list(static_inputs) if static_inputs is not None else static_input_indices(len(placeholders))
    ctx = CompileContext(
        config=config,
        stage=stage,
        record=record,
        input_names=names,
        static_inputs=static,
        mutated_inputs=mutated_placeholders(gm),
    )
    compiled = _compile_by_shape(gm, example_inputs, ctx, mode)
    if not getattr(compiled, "per_key", False):
        record.compiles += 1
    fn = _convention(compiled, boxed)
    record.compile_seconds += time.perf_counter() - t0
    log.info("graphgear: compiled %s (%s, %d ops) in %.2fs", record.name, mode,
             record.num_nodes, record.compile_seconds)
    return fn


def _compile_by_shape(
    gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext, mode: str
) -> Callable[..., Any]:
    """Compile ``gm`` as it is when its shapes are static; otherwise dispatch by graph key.

    max-autotune compiles one static graph per gear (a dynamic graph without gears is
    compiled once, with dynamic shapes); reduce-overhead captures one static graph per
    key; run_eagerly runs the dynamic graph. Gears are checked (and padded) in every mode.
    """
    compiler = MODE_COMPILERS[mode]
    info = ShapeInfo(gm)
    if not info.is_dynamic:
        return compiler(gm, example_inputs, ctx)
    plan = None
    if ctx.stage != "backward":
        plan = GearPlan.build(
            info, example_inputs, ctx.input_names, ctx.config.inference_config.dynamic_gears_merge_policy
        )
    per_key = mode == "reduce-overhead" or (mode == "max-autotune" and plan is not None)
    if per_key and info.unreadable:
        ctx.record.add_fallback(
            "graph key", f"symbols {info.unreadable} occur only inside expressions; compiled "
            "once with dynamic shapes instead of once per key"
        )
        per_key = False
    if not per_key:
        whole = compiler(gm, example_inputs, ctx)
        if plan is None:
            return whole
        whole_boxed = _convention(whole, boxed=True)
        build: Callable[[tuple[int, ...]], Callable[..., Any]] = lambda key: whole_boxed  # noqa: E731
    else:

        def build(key: tuple[int, ...]) -> Callable[..., Any]:
            t0 = time.perf_counter()
            static_gm, static_inputs = specialize(gm, info, key)
            fn = _convention(compiler(static_gm, static_inputs, ctx), boxed=True)
            ctx.record.compiles += 1
            ctx.record.compile_seconds += time.perf_counter() - t0
            log.info("graphgear: %s specialised to key %s", ctx.record.name, key)
            return fn

    geared = GearedGraph(
        info,
        plan,
        build,
        padding=ctx.config.inference_config.gear_padding,
        out_specs=output_specs(gm, info),
        unsliceable=unsliceable_outputs(gm, info),
        mutated=ctx.mutated_inputs,
        record=ctx.record,
        # reduce-overhead captures on the call after its warm-up runs
        calls_to_build=ctx.config.capture_config.warmup_iters + 1 if mode == "reduce-overhead" else 1,
    )
    geared.per_key = per_key
    return geared


def _convention(fn: Callable[..., Any], boxed: bool) -> Callable[..., Any]:
    """Adapt ``fn`` to the boxed (``fn(args_list)``) or plain (``fn(*args)``) convention;
    a callable that is boxed says so with ``_boxed_call = True``."""
    is_boxed = getattr(fn, "_boxed_call", False)
    if boxed == is_boxed:
        return fn
    if boxed:
        return make_boxed_func(fn)

    def unboxed(*args: Any) -> Any:
        return fn(list(args))

    return unboxed

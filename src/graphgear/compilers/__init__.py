"""The compiler of each mode, and :func:`compile_graph`, which every graph goes through:
stats record → dump → FX passes → dump and summary → the mode's compiler."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import fx

from .. import debug
from ..inputs import mutated_placeholders, static_input_indices
from ..passes import post_grad_pass_manager
from ..stats import new_record
from .base import CompileContext
from .eager import compile_eager
from .inductor import compile_inductor

if TYPE_CHECKING:
    from ..config import CompilerConfig

log = logging.getLogger(__name__)

__all__ = ["CompileContext", "compile_graph", "mode_of"]

ModeCompiler = Callable[[fx.GraphModule, Sequence[Any], CompileContext], Callable[..., Any]]


def _reduce_overhead(gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext) -> Callable[..., Any]:
    from ..capture import compile_reduce_overhead

    return compile_reduce_overhead(gm, example_inputs, ctx)


MODE_COMPILERS: dict[str, ModeCompiler] = {
    "eager": compile_eager,
    "max-autotune": compile_inductor,
    "reduce-overhead": _reduce_overhead,
}


def mode_of(config: CompilerConfig) -> str:
    """The compiler that runs: ``eager`` under ``debug.run_eagerly``, else ``config.mode``."""
    return "eager" if config.debug.run_eagerly else config.mode


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
    names = list(input_names) if input_names is not None and len(input_names) == len(placeholders) \
        else placeholders
    record.inputs = names
    debug.dump_graph(gm, config, record.name, stage)
    post_grad_pass_manager(config).run(gm, example_inputs, config, record)
    debug.dump_graph(gm, config, record.name, "final")
    debug.fx_summary(gm, config, record.name, mode)
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
    fn = _convention(MODE_COMPILERS[mode](gm, example_inputs, ctx), boxed)
    record.compiles += 1
    record.compile_seconds += time.perf_counter() - t0
    log.info("graphgear: compiled %s (%s, %d ops) in %.2fs", record.name, mode,
             record.num_nodes, record.compile_seconds)
    return fn


def _convention(fn: Callable[..., Any], boxed: bool) -> Callable[..., Any]:
    """Adapt ``fn`` to the boxed (``fn(args_list)``) or plain (``fn(*args)``) convention;
    a callable that is boxed says so with ``_boxed_call = True``."""
    is_boxed = getattr(fn, "_boxed_call", False)
    if boxed == is_boxed:
        return fn
    if boxed:
        from torch._functorch.aot_autograd import make_boxed_func

        return make_boxed_func(fn)

    def unboxed(*args: Any) -> Any:
        return fn(list(args))

    return unboxed

"""The pipeline every aten-level graph goes through (:func:`compile_graph`): stats
record → dump → FX passes → dump and op summary → dispatch by shape (a callable per gear
or graph key, ``graphgear.dispatch``, padded between gears: ``graphgear.padding``; each
the graph's one compile with dynamic sizes, or one specialised to the key) → the mode's
compiler (``graphgear.compilers``)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import fx

from . import debug
from ._torch.aot import aot_forward_returns, aot_tangents, is_boxed, make_boxed_func
from .capture.rules import graph_device
from .capture.split import rewire_split_ints, split_int_inputs
from .compilers import MODE_COMPILERS, op_support
from .config import mode_of
from .context import CompileContext
from .datadump import copy_graph, dumped_compiler
from .dispatch import Build, GearGuard, GraphFacts, KeyedGraph, ValueOnly
from .gears import GearPlan
from .inputs import aot_input_names, mutated_placeholders, static_input_indices
from .padding import PaddedBackward, PaddedCall
from .passes import post_grad_pass_manager, static_pass_manager
from .regions import region_counts
from .shapes import ShapeInfo, scalar_symbols, specialize, value_only_symbols
from .stats import graph_source, new_record

if TYPE_CHECKING:
    from .cache.artifacts import ArtifactStore, KeyArtifact
    from .config import CompilerConfig

log = logging.getLogger(__name__)

__all__ = ["compile_graph", "rebuild_graph"]

def compile_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    config: CompilerConfig,
    stage: str,
    input_names: Sequence[str] | None = None,
    static_inputs: Sequence[int] | None = None,
    boxed: bool = False,
    artifacts: ArtifactStore | None = None,
    frozen_copies: Any = None,
) -> Callable[..., Any]:
    """Run graphgear's passes on an aten-level graph and compile it in the config's mode.

    Returns ``fn(*args)``, or with ``boxed=True`` AOTAutograd's boxed convention
    ``fn(list_of_args)`` (which lets the callee free inputs early). ``artifacts`` (the
    compile cache): the graph after the passes, and each key's compiled code, are kept
    in it; :func:`rebuild_graph` builds the same callable from it in a later process.
    ``frozen_copies`` (:class:`~graphgear.cpu.frozen.FrozenCopies`): the copies of
    frozen weights this graph shares with the backend's other graphs.
    """
    mode = mode_of(config)
    record = new_record(stage, mode)
    record.source = graph_source(gm)
    t0 = time.perf_counter()
    placeholders = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    names = placeholders
    if input_names is not None and stage != "backward":
        # the user's names, where AOTAutograd's placeholders hold dynamo's inputs
        names = aot_input_names(gm, input_names)
    record.inputs = names
    record.regions = region_counts(gm)
    dump = config.debug.data_dump
    original = copy_graph(gm) if dump.enabled and dump.stage == "original" else None
    debug.dump_graph(gm, config, record.name, stage)
    post_grad_pass_manager(config).run(gm, example_inputs, config, record)
    debug.dump_graph(gm, config, record.name, "final")
    debug.fx_summary(gm, config, record.name, functools.partial(op_support, mode=mode))
    record.num_nodes = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    if dump.enabled:
        # debug.data_dump: the graph runs op by op, its selected nodes dumped (graphgear.datadump)
        record.compiles += 1
        record.compile_seconds += time.perf_counter() - t0
        return _convention(dumped_compiler(gm, original, config, record.name, mode), boxed)
    static = list(static_inputs) if static_inputs is not None else static_input_indices(len(placeholders))
    ctx = CompileContext(
        config=config,
        stage=stage,
        record=record,
        input_names=names,
        static_inputs=static,
        mutated_inputs=mutated_placeholders(gm),
        artifacts=artifacts,
        frozen_copies=frozen_copies,
        caller_outputs=aot_forward_returns() if stage == "forward" else None,
    )
    if artifacts is not None:
        artifacts.keep_graph(gm, example_inputs, {
            "name": record.name, "source": record.source, "stage": stage, "input_names": list(names), "static_inputs": static,
            "mutated_inputs": list(ctx.mutated_inputs), "num_nodes": record.num_nodes,
            "caller_outputs": ctx.caller_outputs})
    compiled = _compile_by_shape(gm, example_inputs, ctx, mode)
    if not getattr(compiled, "per_key", False):
        record.compiles += 1
    fn = _convention(compiled, boxed)
    record.compile_seconds += time.perf_counter() - t0
    log.info("graphgear: compiled %s (%s, %d ops) in %.2fs", record.name, mode,
             record.num_nodes, record.compile_seconds)
    return fn


def rebuild_graph(artifacts: ArtifactStore, config: CompilerConfig) -> Callable[..., Any]:
    """The boxed callable :func:`compile_graph` made of the graph kept in ``artifacts``,
    without its passes: the same dispatch by shape, each stored key's compiled code
    loaded instead of specialised and compiled (a key not stored compiles as usual)."""
    meta = artifacts.meta
    mode = mode_of(config)
    record = new_record(meta["stage"], mode)
    t0 = time.perf_counter()
    gm, example_inputs = artifacts.load_graph()
    record.inputs = list(meta["input_names"])
    record.source = str(meta.get("source", ""))
    record.num_nodes = int(meta.get("num_nodes", 0))
    ctx = CompileContext(
        config=config, stage=meta["stage"], record=record, input_names=list(meta["input_names"]),
        static_inputs=list(meta["static_inputs"]), mutated_inputs=list(meta["mutated_inputs"]),
        artifacts=artifacts, caller_outputs=meta.get("caller_outputs"),
    )
    compiled = _compile_by_shape(gm, example_inputs, ctx, mode)
    fn = _convention(compiled, boxed=True)
    record.compile_seconds += time.perf_counter() - t0
    log.info("graphgear: rebuilt %s (%s) from the compile cache in %.2fs", record.name, mode,
             record.compile_seconds)
    return fn


def _uncompiled(gm: fx.GraphModule, record: Any) -> Callable[[list[Any]], Any]:
    """``gm`` run as it is (boxed), counted as uncaptured runs."""
    def run(args: list[Any]) -> Any:
        record.uncaptured_runs += 1
        return gm(*args)

    return run


def _value_only(gm: fx.GraphModule, info: ShapeInfo, plan: GearPlan | None) -> tuple[list[int], list[Any]]:
    """:func:`~graphgear.shapes.value_only_symbols` of ``gm``, but for geared symbols."""
    symbols, outputs = value_only_symbols(gm, info)
    geared = set(plan.sym_gears) if plan is not None else set()
    symbols = [i for i in symbols if i not in geared]
    if not symbols:
        return [], []
    kept = {info.symbols[i] for i in symbols}
    outputs = [(k, v) for k, v in outputs if set(v.node.expr.free_symbols) & kept]
    if any(not set(v.node.expr.free_symbols) <= set(info.symbols) for _, v in outputs):
        return [], []  # an output of a symbol no input gives (data-dependent): per value
    return symbols, outputs


def _stored(ctx: CompileContext, mode: str, key: tuple[int, ...]) -> KeyArtifact | None:
    """The compile cache's code of graph key ``key``, loaded, or None (not stored, or it
    could not be loaded: then the key is compiled as usual)."""
    if ctx.artifacts is None or mode not in _STORED_KINDS or key not in ctx.artifacts.keys:
        return None
    loaded: KeyArtifact | None = ctx.artifacts.load(key, _STORED_KINDS[mode], ctx.stage)
    if loaded is not None:
        ctx.record.loaded_keys += 1
    return loaded


#: the kinds of stored code per mode (``artifacts.KeyArtifact.kind``)
_STORED_KINDS = {"reduce-overhead": ("static", "pieces"), "max-autotune": ("inductor",)}


def _compile_by_shape(
    gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext, mode: str
) -> Callable[..., Any]:
    """Compile ``gm`` as it is when its shapes are static; otherwise dispatch by graph key.

    A dynamic graph is compiled once with its sizes symbolic and that code serves every
    key (:func:`_shares`): max-autotune runs it, reduce-overhead captures it once per key;
    a key whose sizes ``inference_config.compile_sizes`` names (or every key of a graph
    that cannot share: piecewise cuts, frozen weights, the compile cache) is specialised
    and compiled on its own. run_eagerly runs the dynamic graph. Gears are checked (and padded) in every mode.
    """
    compiler = MODE_COMPILERS[mode](ctx)
    split_ints = _split_ints(gm, ctx, mode)
    info = ShapeInfo(gm, pinned_args=split_ints)
    if not info.is_dynamic:
        return compiler(gm, example_inputs, ctx.for_key((), _stored(ctx, mode, ())))
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
    tangents = aot_tangents(gm) if ctx.stage == "backward" and ctx.config.inference_config.gear_padding else []
    if not per_key:
        whole = compiler(gm, example_inputs, ctx)  # dynamic: one code for every size, not stored
        if plan is None and not tangents:
            return whole
        whole_boxed = _convention(whole, boxed=True)
        build: Build = lambda key: whole_boxed  # noqa: E731
    else:

        shared: list[Callable[..., Any]] = []  # max-autotune's dynamic compile, made once

        def build(key: tuple[int, ...]) -> Callable[..., Any]:
            t0 = time.perf_counter()
            if _shares(ctx, plan, key, example_inputs):
                fn = _shared_build(gm, example_inputs, ctx, mode, compiler, key, shared)
                if fn is not None:
                    ctx.record.compile_seconds += time.perf_counter() - t0
                    ctx.record.key_seconds[str(key)] = time.perf_counter() - t0
                    return fn
            loaded = _stored(ctx, mode, key)
            if loaded is not None and loaded.kind != "pieces":
                # the key's code is loaded; the dynamic graph stands in for the static
                # one where the mode compiler runs the FX graph itself (warm-up)
                fn = _convention(compiler(gm, example_inputs, ctx.for_key(key, loaded)), boxed=True)
                ctx.record.compile_seconds += time.perf_counter() - t0
                log.info("graphgear: %s key %s loaded from the compile cache", ctx.record.name, key)
                return fn
            static_gm, static_inputs = specialize(gm, info, key)
            rewire_split_ints(static_gm, gm, split_ints, ctx.config.capture_config.split_ops)
            static_pass_manager(ctx.config).run(static_gm, static_inputs, ctx.config, ctx.record)
            # stored pieces (a piecewise key) are cut again from the static graph, their
            # code loaded instead of compiled
            fn = _convention(compiler(static_gm, static_inputs, ctx.for_key(key, loaded)), boxed=True)
            if loaded is None:
                ctx.record.compiles += 1
            ctx.record.compile_seconds += time.perf_counter() - t0
            ctx.record.key_seconds[str(key)] = time.perf_counter() - t0
            log.info("graphgear: %s specialised to key %s%s", ctx.record.name, key,
                     " (its pieces' code loaded from the compile cache)" if loaded is not None else "")
            return fn

    facts = _facts(gm, info, plan, ctx, per_key=per_key, tangents=tangents)
    keyed = KeyedGraph(
        facts, build, per_key=per_key, uncompiled=_uncompiled(gm, ctx.record),
        # reduce-overhead captures on the call after its warm-up runs
        calls_to_build=ctx.config.capture_config.warmup_iters + 1 if mode == "reduce-overhead" else 1,
    )
    return _dispatch(gm, facts, keyed, padding=ctx.config.inference_config.gear_padding)


def _shares(ctx: CompileContext, plan: GearPlan | None, key: tuple[int, ...], example_inputs: Sequence[Any]) -> bool:
    """Whether graph key ``key`` takes the graph's one compile with dynamic sizes (its
    own capture in reduce-overhead) rather than a compile specialised to it:
    ``inference_config.compile_sizes`` names the sizes specialised (``"all"``: every
    one); not with the compile cache (it stores code per key) nor for a backward."""
    sizes = ctx.config.inference_config.compile_sizes
    if sizes == "auto":
        # the CPU graph replays Inductor's code of static sizes as a fixed list of kernel
        # calls; code of dynamic sizes it runs through the generated wrapper: 245 against
        # 330 us per step of a 2-layer toy decoder (docs/guides/compile-time.md)
        cpu_graph = ctx.config.mode == "reduce-overhead" and graph_device(example_inputs).type == "cpu"
        sizes = "all" if cpu_graph else ()
    if sizes == "all" or ctx.artifacts is not None or ctx.stage == "backward":
        return False
    values = [key[i] for i in plan.sym_gears] if plan is not None else list(key)
    return not (values and all(v in sizes for v in values))


def _shared_build(gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext, mode: str,
                  compiler: Any, key: tuple[int, ...], shared: list[Callable[..., Any]]) -> Callable[..., Any] | None:
    """Key ``key``'s callable from the graph's shared compile (made on the first key that
    needs it): reduce-overhead, an engine of its own capturing the shared code;
    max-autotune, the shared code itself. None where the graph cannot share one."""
    if mode == "max-autotune":
        if not shared:
            shared.append(_convention(compiler(gm, example_inputs, ctx), boxed=True))
            ctx.record.compiles += 1
        return shared[0]
    if mode != "reduce-overhead":
        return None
    first = compiler._shared is None
    code = compiler.shared(gm, example_inputs, ctx)
    if code is None:
        return None
    if first:
        ctx.record.compiles += 1
    log.info("graphgear: %s key %s captures the shared compile", ctx.record.name, key)
    return _convention(compiler(gm, example_inputs, ctx.for_key(key, code)), boxed=True)


def _split_ints(gm: fx.GraphModule, ctx: CompileContext, mode: str) -> list[int]:
    """The Python-int inputs of ``gm`` that only piecewise capture's split nodes read
    (:func:`~graphgear.capture.split.split_int_inputs`): no part of the graph key."""
    cc = ctx.config.capture_config
    if mode != "reduce-overhead" or cc.mode == "full" or not cc.split_ops or ctx.stage == "backward":
        return []
    return split_int_inputs(gm, cc.split_ops)


def _facts(gm: fx.GraphModule, info: ShapeInfo, plan: GearPlan | None, ctx: CompileContext, *,
           per_key: bool, tangents: Sequence[int]) -> GraphFacts:
    """What the dispatch of dynamic graph ``gm`` needs to know of it."""
    value_only, value_outputs = _value_only(gm, info, plan) if per_key else ([], [])
    geared = set(plan.sym_gears) if plan is not None else set()
    # Python ints that reach tensor values: past a few values, run the graph as it is
    scalars = [i for i in scalar_symbols(info) if i not in geared and i not in value_only
               and i not in info.pinned] if per_key else []
    return GraphFacts(
        info=info, plan=plan, record=ctx.record, mutated=tuple(ctx.mutated_inputs),
        # training: a padded forward returns the caller's outputs sliced and keeps the
        # saved activations at the gear's size; its backward gets the real-size tangents
        # padded to that size, and slices the gradients it returns
        caller_outputs=ctx.caller_outputs, tangents=tuple(tangents),
        # a Python int the graph only advances (no tensor depends on it): one key for all
        value_only=tuple(value_only), value_outputs=tuple(value_outputs), scalars=tuple(scalars),
    )


def _dispatch(gm: fx.GraphModule, facts: GraphFacts, keyed: KeyedGraph, *, padding: bool) -> Callable[..., Any]:
    """``keyed`` with what ``facts`` ask for around it: the padded backward (tangents of
    a backward with gear padding; a backward has no gears), the gear guard (with the
    padded call under ``padding``), the value-only ints."""
    fn: Callable[..., Any] = keyed
    if facts.tangents:
        fn = PaddedBackward(gm, facts, keyed.get, per_key=keyed.per_key)
    if facts.plan is not None:
        padded = PaddedCall(gm, facts, keyed.get) if padding else None
        fn = GearGuard(keyed, facts.plan, padded)
    if facts.value_only:
        fn = ValueOnly(fn, facts)
    return fn


def _convention(fn: Callable[..., Any], boxed: bool) -> Callable[..., Any]:
    """Adapt ``fn`` to the boxed (``fn(args_list)``) or plain (``fn(*args)``) convention;
    a callable that is boxed says so (``_torch.aot.boxed_convention``)."""
    if boxed == is_boxed(fn):
        return fn
    if boxed:
        return make_boxed_func(fn)

    def unboxed(*args: Any) -> Any:
        return fn(list(args))

    return unboxed

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

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from .. import debug
from .._torch.fx import fake_values
from ..cache.artifacts import KeyArtifact, pieces_signature
from ..capture import (
    CaptureEngine,
    CaptureGroup,
    Executor,
    UncapturedGraph,
    device_kind,
    graph_device,
)
from ..capture.devices import DeviceKind
from ..capture.entry import InputRoles
from ..capture.pieces import PiecewiseGraph, piece_record, run_as_is
from ..capture.pool import MemoryPool
from ..capture.rules import warn
from ..capture.split import (
    SplitPoints,
    absent_split_ops,
    split_graph,
    split_op_names,
    split_points,
    split_target,
    writes_in_place,
)
from ..context import CompileContext
from ..cpu import kernels
from ..cpu.frozen import FrozenCopies
from ..debug import op_key
from ..errors import CaptureError, ConfigError
from ..inputs import mutated_placeholders
from ..op_names import split_op_problem
from ..regions import RegionsRefused, region_subgraphs
from .executors import FrozenExecutor, native_code
from .inductor import compile_dynamic, compile_static

log = logging.getLogger(__name__)

__all__ = ["ReduceOverheadCompiler"]


class ReduceOverheadCompiler:
    """The reduce-overhead compiler of one FX graph (see the module docstring)."""

    def __init__(self, ctx: CompileContext) -> None:
        self.group = CaptureGroup.for_graph(ctx.record.name)
        # the copies of frozen weights: the backend's (shared by its graphs), else this graph's
        self.copies = ctx.frozen_copies if ctx.frozen_copies is not None else FrozenCopies()
        # piecewise capture: each piece's memory, shared by that piece of every key
        self.piece_pools: dict[int, MemoryPool] = {}
        # the dynamic graph's code every key captures (:meth:`shared`): None not tried yet,
        # False where each key compiles on its own
        self._shared: KeyArtifact | bool | None = None
        cc = ctx.config.capture_config
        if cc.mode == "full" and cc.split_ops:
            raise ConfigError(
                f"graphgear: capture_config.split_ops={list(cc.split_ops)!r} needs capture_config.mode "
                f"'piecewise' or 'full_and_piecewise', got mode='full' (which captures each graph "
                f"whole). Set capture_config.mode='piecewise', or leave split_ops empty."
            )
        # a torch.library namespace unknown when the config was built must exist by now
        for name in cc.split_ops:
            problem = split_op_problem(name, unknown_namespace_ok=False)
            if problem is not None:
                raise ConfigError(
                    f"graphgear: capture_config.split_ops={list(cc.split_ops)!r}: {problem}. Fix the "
                    f"name, or remove it from split_ops."
                )

    def shared(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext) -> KeyArtifact | None:
        """The code of dynamic graph ``gm`` compiled once with its symbolic sizes, which
        the engine of every graph key captures (made on the first call, then the same);
        None where each key must be compiled on its own: piecewise capture cuts the
        graph, weights are frozen into the code, the device captures the FX graph itself,
        or Inductor could not compile it."""
        if self._shared is not None:
            return self._shared or None
        self._shared = False
        device = graph_device(example_inputs)
        kind = device_kind(device, ctx.record.name)
        points = _split_points(gm, device, ctx)
        if points.nodes or points.blocked or ctx.config.experimental_config.frozen_parameter:
            return None
        roles = InputRoles.of(example_inputs, stage=ctx.stage, static_inputs=ctx.static_inputs,
                              mutated_inputs=ctx.mutated_inputs,
                              clone_input=ctx.config.capture_config.clone_input)
        code = native_code(functools.partial(compile_dynamic, config=ctx.config, record=ctx.record), gm,
                           roles.as_bound(example_inputs), kind=kind, stage=ctx.stage, static_idx=roles.static,
                           name=ctx.record.name)
        if code is not None:
            self._shared = KeyArtifact("static", code)
            log.info("graphgear: %s compiled once with dynamic sizes; each size captures that code",
                     ctx.record.name)
        return self._shared or None

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext) -> Callable[..., Any]:
        """A boxed callable that captures and replays ``gm`` (whole, or in pieces:
        ``capture_config.mode``), or (``fallback="eager"``) runs a graph that cannot be
        captured as it is.

        ``ctx.loaded`` (the compile cache): the key's Inductor code, stored by a first
        process that captured it; the engine captures that code (no decomposition, no
        Inductor compile) and ``gm`` (then possibly the dynamic graph) only runs its
        warm-up. With ``ctx.artifacts`` and ``ctx.key``, the code compiled here is
        recorded there; a piecewise key's pieces are recorded together (kind ``"pieces"``)
        and, loaded, are cut again from ``gm`` (then the static graph) and take their code
        from the cache."""
        device = graph_device(example_inputs)
        if ctx.loaded is None or ctx.loaded.kind == "pieces":
            if ctx.loaded is not None:  # a rebuilt graph keeps no node values: the cut reads them
                _fill_values(gm, example_inputs, [n for n in gm.graph.nodes if n.op == "call_function"])
            points = _split_points(gm, device, ctx)
            for sub in region_subgraphs(gm):
                inner = _split_points(sub, device, ctx)
                if inner.nodes or inner.blocked:
                    raise RegionsRefused(
                        f"{ctx.record.name}: a repeated region holds ops piecewise capture cuts at "
                        f"({', '.join(op for op, _ in inner.why) or 'uncapturable ops'})")
            if points.blocked:
                return _uncapturable(gm, ctx, device, points.blocked)
            if points.nodes:
                return self._piecewise(gm, example_inputs, ctx, device, points)
            ctx = ctx.for_key(ctx.key)  # stored as pieces, now cut nowhere: compiled whole
        return self._engine(gm, example_inputs, ctx, device, device_kind(device, ctx.record.name))

    def _engine(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext,
                device: Any, kind: DeviceKind, pool: MemoryPool | None = None,
                compiled_pieces: list[Any] | None = None) -> CaptureEngine:
        """The capture engine of one static graph (a whole graph key, or one piece, whose
        compiled code is appended to ``compiled_pieces``)."""
        engine = functools.partial(CaptureEngine, gm, example_inputs, ctx, kind=kind, device=device,
                                   group=self.group, pool=pool)
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
        if compiled_pieces is not None:
            compiled_pieces.append(compiled)
        if compiled is not None and ctx.artifacts is not None and ctx.key is not None:
            ctx.artifacts.record(ctx.key, "static", compiled)
        return engine(executor=Executor(kind.code(compiled, gm, ctx.record.name)))

    def _piecewise(self, gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext,
                   device: Any, points: SplitPoints) -> PiecewiseGraph:
        """``gm`` cut at ``points``: an engine per captured piece, the split nodes run as
        they are between them (:mod:`graphgear.capture.pieces`)."""
        kind = device_kind(device, ctx.record.name)
        for op, why in points.why:
            ctx.record.add_split(op, why)
        # a listed op that writes its input (a KV-cache write) writes it, not a clone
        gm, split = writes_in_place(gm, set(points.nodes))
        segments = split_graph(gm, split)
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        index = {p: i for i, p in enumerate(placeholders)}
        _fill_values(gm, example_inputs, [a for seg in segments for a in seg.inputs if a not in index])
        static = set(ctx.static_inputs)
        # the graph's inputs it writes (a KV cache) are used in place by every piece,
        # also by one that only reads them (a split node wrote them): never copied
        written = set(ctx.mutated_inputs)
        signature = pieces_signature([(seg.ops, len(seg.inputs)) for seg in segments if seg.captured])
        stored = _stored_pieces(ctx, signature)
        compiled: list[Any] = []
        runs: list[Callable[[list[Any]], Any]] = []
        piece = 0
        for seg in segments:
            if not seg.captured:
                runs.append(run_as_is(seg))
                continue
            rec = piece_record(ctx.record, piece, seg.ops)
            pctx = dataclasses.replace(
                ctx, record=rec, input_names=[a.name for a in seg.inputs],
                static_inputs=[j for j, a in enumerate(seg.inputs) if index.get(a) in static],
                mutated_inputs=sorted(set(mutated_placeholders(seg.gm))
                                      | {j for j, a in enumerate(seg.inputs) if index.get(a) in written}),
                caller_outputs=None, artifacts=None, key=None,
                loaded=KeyArtifact("static", stored[piece]) if stored is not None else None)
            debug.dump_graph(seg.gm, ctx.config, rec.name, "piece")
            pool = self.piece_pools.setdefault(piece, MemoryPool(name=rec.name))
            examples = [example_inputs[index[a]] if a in index else a.meta["val"] for a in seg.inputs]
            runs.append(self._engine(seg.gm, examples, pctx, device, kind, pool=pool, compiled_pieces=compiled))
            piece += 1
        # stored where every piece has Inductor code of its own (not frozen weights' code,
        # made per set of weights, nor a device that captures the FX graph itself)
        if (stored is None and ctx.artifacts is not None and ctx.key is not None and len(compiled) == piece
                and all(c is not None for c in compiled)):
            ctx.artifacts.record(ctx.key, "pieces", compiled, spec=signature)
        log.info("graphgear: %s (%s) captured in %d pieces, split at %s%s", ctx.record.name, ctx.stage,
                 piece, ", ".join(op for op, _ in points.why),
                 "; their code loaded from the compile cache" if stored is not None else "")
        return PiecewiseGraph(gm, segments, runs, warmup_calls=ctx.config.capture_config.warmup_iters + 1)


def _stored_pieces(ctx: CompileContext, signature: str) -> list[Any] | None:
    """The compile cache's code of each captured piece of this key, where it was stored
    for a cut with the same ``signature`` (else None: the pieces are compiled)."""
    loaded = ctx.loaded
    if loaded is None or loaded.kind != "pieces":
        return None
    if loaded.spec != signature:
        log.warning("graphgear cache: %s key %s was stored cut into other pieces (%s, now %s); "
                    "compiling its pieces instead", ctx.record.name, ctx.key, loaded.spec, signature)
        return None
    return list(loaded.code)


def _split_points(gm: fx.GraphModule, device: Any, ctx: CompileContext) -> SplitPoints:
    """Where ``gm`` is cut (``capture_config.mode``): nowhere in ``'full'`` (what cannot be
    captured then blocks the whole graph); at every ``split_ops`` node in ``'piecewise'``;
    in ``'full_and_piecewise'`` only at those that read a Python int of the call (a split
    op whose arguments the graph key fixes is captured with the rest). Ops a device graph
    cannot hold are cut at in both (``split_uncapturable``)."""
    cc = ctx.config.capture_config
    if cc.mode == "full":
        return split_points(gm, device, split_ops=(), split_uncapturable=False)
    points = split_points(gm, device, split_ops=cc.split_ops, split_uncapturable=cc.split_uncapturable)
    absent = absent_split_ops(gm, cc.split_ops)
    if absent:
        log.debug("graphgear: %s (%s) holds no node of split_ops %s", ctx.record.name, ctx.stage, absent)
    if cc.mode == "full_and_piecewise" and cc.split_ops:
        listed = split_op_names(cc.split_ops)
        for n in [n for n in points.nodes if op_key(split_target(n)) in listed and not _reads_call_int(n)]:
            points.nodes.discard(n)
        kept = {op_key(split_target(n)) for n in points.nodes}
        points.why = [(op, why) for op, why in points.why if op in kept]
    return points


def _reads_call_int(n: fx.Node) -> bool:
    """Whether ``n`` reads a Python-int input of the graph (one the graph key leaves free)."""
    return any(a.op == "placeholder" and not isinstance(a.meta.get("val"), torch.Tensor)
               for a in n.all_input_nodes)


def _fill_values(gm: fx.GraphModule, example_inputs: Sequence[Any], needed: Sequence[fx.Node]) -> None:
    """Give ``needed`` nodes their example value (``meta["val"]``) where a pass left none."""
    if all("val" in n.meta for n in needed):
        return
    fake_values(gm, example_inputs)


def _uncapturable(gm: fx.GraphModule, ctx: CompileContext, device: Any,
                  blocked: list[tuple[str, str]]) -> Callable[..., Any]:
    """A graph with ops its device graph cannot hold: ``fallback='raise'`` raises, else it
    runs as it is, with one warning."""
    for op, reason in blocked:
        ctx.record.add_fallback(op, reason)
    listing = "; ".join(f"{op}: {reason}" for op, reason in blocked)
    ops = ", ".join(dict.fromkeys(op for op, _ in blocked))
    cc = ctx.config.capture_config
    if all(reason.startswith("control flow") for _, reason in blocked):
        # a cut cannot serve an op whose graph changes with the data
        hint = f"{ops} changes the graph with the data, so no split can keep the rest captured"
    elif cc.mode == "full":
        hint = (f"capture_config.mode='full_and_piecewise' (the default) runs {ops} uncaptured "
                f"between captured pieces instead")
    else:
        listable = [op for op in dict.fromkeys(op for op, _ in blocked) if "." in op]
        hint = ("capture_config.split_uncapturable=True"
                + (f" (or split_ops={listable!r})" if listable else "")
                + f" runs {ops} uncaptured between captured pieces instead")
    if cc.fallback == "raise":
        raise CaptureError(
            f"graphgear: {ctx.record.name} ({ctx.stage}) cannot be captured into a "
            f"{device.type} graph: {listing}. capture_config.fallback='raise' forbids running "
            f"it uncaptured; {hint}, or set fallback='eager', or move the op out of the compiled region."
        )
    warn(
        f"graphgear: {ctx.record.name} ({ctx.stage}) cannot be captured into a {device.type} "
        f"graph ({listing}); the whole graph runs uncaptured (fallback='eager'): {hint}; "
        f"or move the op out of the compiled region, or set fallback='raise' to make this an error."
    )
    return UncapturedGraph(gm, ctx.record)

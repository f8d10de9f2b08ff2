"""The backend pipeline, in the shape of TorchAir's ``_npu_backend``.

For each graph dynamo hands over, :class:`GraphgearBackend`:

1. records per-input attributes (names, gears, static inputs, parameters);
2. wraps the mode's compiler into forward, inference and joint compilers
   (:func:`_wrap_compiler`; the inference compiler runs the joint-graph passes when
   ``experimental_config.fx_passes`` is on);
3. wraps the forward and inference compilers in the gear guard (:func:`_set_gear_to_compiler`);
4. picks the partition function (:func:`_get_partition_fn`);
5. for training graphs with ``fx_passes`` on, runs the fusions on the forward graph before
   differentiation (:func:`graphgear.passes.joint.pre_grad_fusions`), so the fused ops
   bring their own backward;
6. calls ``aot_module_simplified`` with the compilers, the partition function, the merged
   decompositions and ``keep_inference_input_mutations``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from . import debug
from ._torch.aot import aot_module_simplified, aot_partition_fn
from ._torch.dynamo import backend_compiler_failed, compile_session, has_dynamo_graph_arg
from ._torch.fx import fake_mode_of, make_fx_allowing_real_inputs, tracing, unset_fake_temporarily
from ._torch.ops import OpOverload
from ._torch.serialize import aot_bundling, serializable_compiler
from .cache.bundle import GraphgearOutputCode, bundled_compiler
from .capture import MemoryPool
from .capture.rules import graph_device
from .compilers.inductor import inductor_decompositions
from .config import CompilerConfig, apply_options, check_options, mode_of
from .cpu.frozen import FrozenCopies
from .errors import ConfigError, GraphgearError
from .gears import guard_gears_shape, keep_size_one_dynamic, set_dim_gears
from .inputs import GraphInputs, aot_input_names, aot_input_positions
from .option_checks import check_combinations, warn_idle_options
from .passes import check_disabled_passes
from .passes.joint import joint_graph_passes, pre_grad_fusions
from .passes.remove_cat import runs_as_is
from .pipeline import compile_graph
from .regions import RegionsRefused, outline_repeated_regions
from .stats import after_warm, graph_source

log = logging.getLogger(__name__)

__all__ = ["GraphgearBackend", "get_backend", "get_compiler", "graphgear_backend"]

# torch.compile(mode=...) values and what they mean for graphgear
_TORCH_MODES = {
    "default": None,
    "reduce-overhead": "reduce-overhead",
    "max-autotune": "max-autotune",
    "max-autotune-no-cudagraphs": "max-autotune",
}


def _wrap_compiler(compiler: Callable[..., Any], config: CompilerConfig):  # type: ignore[no-untyped-def]
    """Forward, inference and joint (backward) compilers around one mode compiler."""

    @functools.wraps(compiler)
    def wrapped_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any], is_inference: bool) -> Any:
        if is_inference and config.experimental_config.fx_passes:
            joint_graph_passes(gm, example_inputs, config)
        return compiler(gm, example_inputs, stage="inference" if is_inference else "forward")

    @functools.wraps(compiler)
    def joint_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        # AOTAutograd compiles the backward at the first backward call, outside dynamo's
        # compile: hold what dynamo holds (as Inductor's own backward compiler does)
        with compile_session():
            return compiler(gm, example_inputs, stage="backward")

    fw_compiler = functools.partial(wrapped_compiler, is_inference=False)
    inference_compiler = functools.partial(wrapped_compiler, is_inference=True)
    return fw_compiler, inference_compiler, joint_compiler


def _set_gear_to_compiler(
    compiler: Callable[..., Any],
    config: CompilerConfig,
    input_dim_gears: Mapping[int, Mapping[int, list[int]]],
    names: Sequence[str] = (),
    num_inputs: int | None = None,
) -> Callable[..., Any]:
    """Record each input's gears on the compiler's example inputs and check them.

    ``input_dim_gears`` is keyed by the position among the ``num_inputs`` inputs dynamo
    handed over (default ``len(names)``); :func:`graphgear.inputs.aot_input_positions`
    finds each one among the AOT graph's placeholders (AOTAutograd adds inputs in front
    and flattens tensor-subclass inputs in place).
    """
    n = len(names) if num_inputs is None else num_inputs

    @functools.wraps(compiler)
    def gear_compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        where = aot_input_positions(gm, n)
        for i, dim_gears in input_dim_gears.items():
            j = where.get(i)
            if j is not None and j < len(example_inputs) and isinstance(example_inputs[j], torch.Tensor):
                set_dim_gears(example_inputs[j], dict(dim_gears))
            else:
                log.warning(
                    "graphgear: gears %s of input %d (%s) were not applied: the compiled graph does "
                    "not take that input as a plain tensor (%d inputs for dynamo's %d; a tensor "
                    "subclass such as a DTensor is passed as its inner tensors)",
                    dict(dim_gears), i, names[i] if i < len(names) else "?", len(example_inputs), n,
                )
        guard_gears_shape(example_inputs, aot_input_names(gm, names) if len(names) == n else
                          [p.name for p in gm.graph.find_nodes(op="placeholder")])
        return compiler(gm, example_inputs)

    return gear_compiler


def _get_partition_fn(config: CompilerConfig, pre_grad_done: bool = False) -> Callable[..., Any]:
    # max-autotune partitions as Inductor does: Inductor's backward compile of a
    # default_partition graph gave wrong gradients on the toy decoder (KV-cache writes)
    base = aot_partition_fn(min_cut=mode_of(config) == "max-autotune")
    if not config.experimental_config.fx_passes or pre_grad_done:
        return base  # pre_grad_done: the fusions ran before differentiation

    def partition_fn(graph: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        joint_graph_passes(graph, joint_inputs, config)
        return base(graph, joint_inputs, **kwargs)

    return partition_fn


def default_decompositions(config: CompilerConfig) -> dict[Any, Any]:
    """Decompositions AOTAutograd applies per mode: Inductor's table for max-autotune;
    none otherwise (run_eagerly runs the aten graph as AOTAutograd gives it;
    reduce-overhead decomposes each static graph itself before compiling it, in
    ``compilers.inductor.decompose_static``)."""
    if mode_of(config) == "max-autotune":
        return inductor_decompositions()
    return {}


def decompose_aten_graph(
    gm: fx.GraphModule, example_inputs: Sequence[Any], table: Mapping[Any, Callable[..., Any]]
) -> fx.GraphModule:
    """``gm`` (an aten graph, as ``make_fx`` gives it) re-traced with the decompositions
    in ``table`` applied, as AOTAutograd applies them to dynamo's graphs; ``gm`` itself
    when the table is empty. Traced on fake tensors (the example inputs' own fake mode
    when they are fake, keeping their symbolic sizes), so no real work runs."""
    if not table:
        return gm

    fake_mode = fake_mode_of(example_inputs)
    with unset_fake_temporarily(), tracing(None):
        if fake_mode is not None:
            with fake_mode:
                return make_fx(gm, decomposition_table=dict(table), tracing_mode="real",
                               record_module_stack=False)(*example_inputs)
        return make_fx_allowing_real_inputs(gm, decomposition_table=dict(table),
                                            record_module_stack=False)(*example_inputs)


class GraphgearBackend:
    """A ``torch.compile`` backend: ``torch.compile(model, backend=GraphgearBackend(config))``.

    Holds its own copy of the config: changing the caller's config object afterwards
    does not change an existing backend.
    """

    __name__ = "graphgear"  # dynamo names the backend by it in its messages

    def __init__(
        self,
        compiler_config: CompilerConfig | None = None,
        custom_decompositions: Mapping[Any, Callable[..., Any]] | None = None,
    ) -> None:
        if compiler_config is not None and not isinstance(compiler_config, CompilerConfig):
            raise TypeError(
                f"graphgear.get_backend: compiler_config must be a graphgear.CompilerConfig, "
                f"got {type(compiler_config).__name__}."
            )
        self.config = (compiler_config or CompilerConfig()).copy()
        check_disabled_passes(self.config)
        check_combinations(self.config)
        # the messages of options without effect already warned of (once per backend)
        self._warned: set[str] = set()
        self.custom_decompositions = dict(custom_decompositions or {})
        # one MemoryPool per raw device pool handle given to use_custom_pool, so every
        # graph of this backend that names the handle shares one pool (and its liveness)
        self._pools: dict[Any, MemoryPool] = {}
        self._own_pool(self.config)
        # packed and concatenated copies of frozen weights, shared by every graph and
        # gear this backend compiles (frozen_parameter)
        self._frozen_copies = FrozenCopies()

    def _own_pool(self, config: CompilerConfig) -> None:
        """Replace a raw device pool handle in ``use_custom_pool`` by this backend's
        :class:`MemoryPool` for it."""
        handle = config.capture_config.use_custom_pool
        if handle is not None and not isinstance(handle, MemoryPool):
            if handle not in self._pools:
                self._pools[handle] = MemoryPool(pool_id=handle, name=f"custom {handle}")
            config.capture_config.use_custom_pool = self._pools[handle]

    def get_compiler_config(self) -> None:  # dynamo asks backends for this
        return None

    def _config_for_call(self, mode: str | None, options: Mapping[str, Any] | None) -> CompilerConfig:
        check_options(options)
        if mode is None and not options:
            return self.config
        config = self.config.copy()
        if mode is not None:
            if mode not in _TORCH_MODES:
                raise ConfigError(
                    f"graphgear: torch.compile(mode={mode!r}) is not a mode graphgear knows; "
                    f"allowed: {', '.join(map(repr, _TORCH_MODES))}."
                )
            if _TORCH_MODES[mode] is not None:
                config.mode = _TORCH_MODES[mode]
        apply_options(config, options)
        check_disabled_passes(config)
        check_combinations(config)
        self._own_pool(config)
        return config

    def _warn_idle_options(self, config: CompilerConfig, example_inputs: Sequence[Any]) -> None:
        warn_idle_options(config, graph_device(example_inputs).type,
                          runs_as_is=runs_as_is(config, example_inputs), seen=self._warned)

    def __call__(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        mode: str | None = None,
        options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> Callable[..., Any]:
        try:
            return self._compile(gm, example_inputs, mode, options, kwargs)
        except GraphgearError as e:
            if not _from_dynamo(gm):
                raise  # called directly, not by dynamo
            # Dynamo re-raises its own BackendCompilerFailed as it is; building it here
            # keeps graphgear's error as __cause__ (dynamo's wrapper would drop it).
            raise backend_compiler_failed(self, e, inspect.currentframe()) from e

    def _compile(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        mode: str | None,
        options: Mapping[str, Any] | None,
        kwargs: Mapping[str, Any],
        bundle: list[GraphgearOutputCode] | None = None,
    ) -> Callable[..., Any]:
        if kwargs:
            raise ConfigError(
                f"graphgear: unexpected backend arguments {sorted(kwargs)}; torch.compile "
                "passes mode= and options= only."
            )
        config = self._config_for_call(mode, options)
        source = graph_source(gm)
        if after_warm("graph", f"dynamo handed graphgear a new graph{f' ({source})' if source else ''}",
                      "Warm up with every input shape, dtype and code path the server meets (a size "
                      "dynamo has not seen vary gets a graph of its own: mark such dims dynamic with "
                      "graphgear.set_dim_gears)."):
            return gm  # runs as it is: dynamo's graph is a callable module
        self._warn_idle_options(config, example_inputs)
        input_gears = config.inference_config.input_gears
        inputs = GraphInputs.from_dynamo(gm, example_inputs, input_gears)
        if input_gears and inputs.dim_gears:
            # as set_dim_gears does: a later recompile must not specialise size 1
            keep_size_one_dynamic([s for d in inputs.dim_gears.values() for g in d.values() for s in g])
        if config.debug.graph_dump.type is not None:
            debug.dump_graph(gm, config, "dynamo", "dynamo")
        compiler: Callable[..., Any] = functools.partial(
            compile_graph, config=config, input_names=inputs.names, boxed=True,
            frozen_copies=self._frozen_copies,
        )
        if bundle is not None:
            compiler = bundled_compiler(compiler, config, bundle)
        fw_compiler, inference_compiler, joint_compiler = _wrap_compiler(compiler, config)
        n = len(example_inputs)
        fw_compiler = _set_gear_to_compiler(fw_compiler, config, inputs.dim_gears, inputs.names, n)
        inference_compiler = _set_gear_to_compiler(
            inference_compiler, config, inputs.dim_gears, inputs.names, n
        )
        decompositions = default_decompositions(config)
        decompositions.update(self.custom_decompositions)
        # training: fuse the forward before AOTAutograd differentiates it, so the fused
        # ops bring their own backward (the joint graph rarely shows the patterns whole)
        fused = pre_grad_fusions(gm, example_inputs, config)
        gm = fused if fused is not None else gm

        def aot(graph: fx.GraphModule) -> Callable[..., Any]:
            return aot_module_simplified(
                graph,
                example_inputs,
                fw_compiler=serializable_compiler(fw_compiler) if bundle is not None else fw_compiler,
                bw_compiler=joint_compiler,
                inference_compiler=inference_compiler,
                partition_fn=_get_partition_fn(config, pre_grad_done=fused is not None),
                decompositions=decompositions,
                keep_inference_input_mutations=config.experimental_config.keep_inference_input_mutations,
            )

        outlined, regions = (outline_repeated_regions(gm) if _outlines(config, bundle, example_inputs)
                             else (gm, {}))
        if not regions:
            return aot(gm)
        try:
            return aot(outlined)
        except RegionsRefused as e:
            log.info("graphgear: %s; compiling every region on its own", e)
            return aot(gm)
        except GraphgearError:
            raise
        except Exception as e:  # noqa: BLE001 - torch's own refusal of the subgraph: compile it whole
            log.warning(
                "graphgear: the graph's repeated regions (%s) could not be compiled as shared subgraphs "
                "(%s: %s); compiling every region on its own instead (slower to compile, same result). "
                "To skip the attempt: experimental_config.repeated_regions = False",
                ", ".join(f"{n} x{c}" for n, c in regions.items()), type(e).__name__, e)
            return aot(gm)


    def compile_bundled(self, gm: fx.GraphModule, example_inputs: Sequence[Any],
                        tag: str) -> tuple[Callable[..., Any], list[GraphgearOutputCode]]:
        """Compile as :meth:`__call__` does, keeping AOTAutograd's bundled entry
        (``result.serialize()``) whose compiled graphs are graphgear's
        :class:`~graphgear.cache.bundle.GraphgearOutputCode`; also returns those (one per
        graph AOTAutograd compiled). ``tag`` keeps AOTAutograd's own on-disk copy of the
        entry apart from other compiles of the same graph (``_torch.serialize.aot_bundling``)."""
        made: list[GraphgearOutputCode] = []
        with aot_bundling(tag):
            compiled = self._compile(gm, example_inputs, None, None, {}, bundle=made)
        return compiled, made


def _outlines(config: CompilerConfig, bundle: Any, example_inputs: Sequence[Any]) -> bool:
    """Whether the graph's repeated regions become shared subgraphs
    (``experimental_config.repeated_regions``, :mod:`graphgear.regions`; ``"auto"``: not
    in reduce-overhead on the CPU): for graphs of static sizes only, for inference
    graphs only (a training graph's shared subgraphs gave wrong gradients on torch 2.13),
    not with the joint-graph fusions (``fx_passes``: their patterns are matched on the
    whole graph), not with gear padding (its hazard check reads every op), not where a
    user asked for pieces (``split_ops``: the cuts are inside
    the layers),
    for frozen weights (their packed copies are per layer), for a data dump (op by op),
    or for the compile cache (its entries keep graphs without subgraphs)."""
    ec = config.experimental_config
    training = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)
    wanted = ec.repeated_regions
    if wanted == "auto":
        # the CPU graph replays straight-line code as a fixed list of kernel calls; code
        # that calls a shared subgraph it runs through Inductor's wrapper (slower per step)
        wanted = not (mode_of(config) == "reduce-overhead" and graph_device(example_inputs).type == "cpu")
    # a shared subgraph in code of dynamic sizes gave wrong outputs at every size but the
    # first (torch 2.13, Inductor, a toy decoder with gears): graphs of static sizes only
    dynamic = any(isinstance(t, torch.SymInt) or (isinstance(t, torch.Tensor) and any(
        isinstance(d, torch.SymInt) for d in (*t.shape, *t.stride()))) for t in example_inputs)
    return (bool(wanted) and not training and not dynamic and not ec.fx_passes
            and not config.inference_config.gear_padding and not ec.frozen_parameter and not config.debug.data_dump.enabled
            and not (mode_of(config) == "reduce-overhead" and config.capture_config.split_ops)
            and bundle is None)


def _from_dynamo(gm: fx.GraphModule) -> bool:
    return any(has_dynamo_graph_arg(n) for n in gm.graph.find_nodes(op="placeholder"))


def get_backend(
    compiler_config: CompilerConfig | None = None,
    custom_decompositions: Mapping[Any, Callable[..., Any]] | None = None,
) -> GraphgearBackend:
    """A backend for ``torch.compile`` built from ``compiler_config`` (default config if None)."""
    return GraphgearBackend(compiler_config, custom_decompositions)


def graphgear_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """The backend registered as ``"graphgear"``: default config, ``options=`` applied
    (one backend per graph: its warnings of options without effect are once per process)."""
    backend = GraphgearBackend()
    backend._warned = _STRING_BACKEND_WARNED
    return backend(gm, example_inputs, **kwargs)


#: the ``"graphgear"`` string backend's warnings of options without effect, already given
_STRING_BACKEND_WARNED: set[str] = set()


def _is_aten_graph(gm: fx.GraphModule) -> bool:
    for n in gm.graph.nodes:
        if n.op == "call_module":
            return False
        if n.op == "call_function" and not isinstance(n.target, OpOverload):
            if n.target not in (operator.getitem,):
                return False
        if n.op == "call_method":
            return False
    return True


def get_compiler(config: CompilerConfig | None = None) -> Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]]:
    """The FX compiler alone: ``compiler(gm, example_inputs) -> callable``.

    Aten-level graphs (``make_fx``) go straight to the mode's compiler, after the mode's
    decompositions (Inductor's table in max-autotune: Inductor lowers ``aten.t`` and
    friends only through them); torch-level graphs (dynamo, ``symbolic_trace``) go
    through the whole pipeline first.
    """
    config = (config or CompilerConfig()).copy()
    backend = GraphgearBackend(config)

    def compiler(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if _is_aten_graph(gm):
            backend._warn_idle_options(config, example_inputs)
            gm = decompose_aten_graph(gm, example_inputs, default_decompositions(config))
            return compile_graph(gm, example_inputs, config=config, stage="inference", static_inputs=[])
        out = next(iter(gm.graph.find_nodes(op="output")))
        if isinstance(out.args[0], tuple | list):
            return backend(gm, example_inputs)
        # AOTAutograd wants tuple outputs: wrap a single output, unwrap it at run time
        out.args = ((out.args[0],),)
        gm.recompile()
        compiled = backend(gm, example_inputs)
        return lambda *args: compiled(*args)[0]

    return compiler

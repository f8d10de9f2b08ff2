"""Typed compiler configuration, validated on assignment.

``CompilerConfig`` is a tree of small config objects, one per concern (as TorchAir's
``configs/``): ``debug``, ``experimental_config``, ``inference_config`` and
``capture_config``. Every leaf is an :class:`Option` that checks each value assigned
to it; assigning an unknown attribute or a value outside an option's allowed set raises
``ValueError`` naming the option and what is allowed. Values live on the instance, so
two configs (and two backends) never share state.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Mapping
from typing import Any

from .errors import ConfigError
from .op_names import clean_split_ops, split_ops_problem
from .option_tree import Option, Section, did_you_mean

__all__ = [
    "OPTION_ALIASES",
    "CaptureConfig",
    "CompilerConfig",
    "DataDumpConfig",
    "DebugConfig",
    "ExperimentalConfig",
    "FxSummaryConfig",
    "GraphDumpConfig",
    "InferenceConfig",
    "Option",
    "apply_options",
]


def _is_int(lo: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _is_pass(v: Any) -> bool:
    return v is None or callable(v)


def _is_str(v: Any) -> bool:
    return isinstance(v, str) and bool(v)


_BOOL = (True, False)


def _is_names(v: Any) -> bool:
    return isinstance(v, tuple | list) and all(isinstance(x, str) and x for x in v)


def _is_steps(v: Any) -> bool:
    return isinstance(v, tuple | list) and all(_is_int(0)(x) for x in v)


class GraphDumpConfig(Section):
    """``debug.graph_dump``: a file of each graph at each stage, ``gg_<seq>_<graph>_<stage>.<ext>``
    (see ``graphgear.debug``)."""

    type = Option(None, "dump each graph at each stage: 'txt' (tabular) or 'py' (code)",
                  choices=(None, "txt", "py"))
    path = Option(".", "folder the dumps go to", check=_is_str, allowed="a non-empty path string")


class FxSummaryConfig(Section):
    """``debug.fx_summary``: a CSV of each graph's ops, ``gg_<seq>_<graph>_summary.csv``, with
    the columns ``op,count,supported,note``."""

    type = Option(None, "'csv': write one row per op type: its count and whether the mode "
                  "supports it", choices=(None, "csv"))
    path = Option(".", "folder the summaries go to", check=_is_str, allowed="a non-empty path string")


class DataDumpConfig(Section):
    """``debug.data_dump``: the output of each selected node of each graph, per call, for
    accuracy work (as TorchAir's data dump; see ``graphgear.debug.compare``). While it is
    on, graphgear runs each graph op by op (nothing is compiled or captured) and writes
    ``<path>/<graph>/call_<n>.pt`` (a dict of tensors, ``torch.load(..., weights_only=True)``
    reads it) and ``<path>/<graph>/index.json`` (node, op, shape, dtype, stats, source line)."""

    enabled = Option(False, "dump node outputs (TorchAir's dump_tensor_data); the graph runs op by op", choices=_BOOL)
    path = Option(".", "folder the per-graph dump folders go to", check=_is_str, allowed="a non-empty path string")
    stage = Option("optimized", "which graph is run and dumped: 'original' (as AOTAutograd gives "
                   "it, before graphgear's passes) or 'optimized' (after them, what the mode compiles)",
                   choices=("original", "optimized"))
    steps = Option((), "calls to dump, counted from 0 per graph (empty: every call)", check=_is_steps,
                   allowed="a tuple or list of ints >= 0", convert=tuple)
    ops = Option((), "dump only nodes of these ops, e.g. 'aten.mm' or 'aten.mm.default' (empty: every op)",
                 check=_is_names, allowed="a tuple or list of op names", convert=tuple)
    nodes = Option((), "dump only nodes whose names match one of these globs, e.g. 'mm*' (empty: every node)",
                   check=_is_names, allowed="a tuple or list of node-name globs", convert=tuple)


class DebugConfig(Section):
    """``debug``: graph dumps, op summaries, data dumps, and running the graph without
    compiling it. ``force_eager`` (TorchAir's npugraph_ex name) is an alias of ``run_eagerly``."""

    _aliases = {"force_eager": "run_eagerly"}
    graph_dump = GraphDumpConfig
    fx_summary = FxSummaryConfig
    data_dump = DataDumpConfig
    run_eagerly = Option(False, "run the optimised FX graph as it is: no capture, no codegen",
                         choices=_BOOL)


class ExperimentalConfig(Section):
    """``experimental_config``: the FX passes and their switches. ``npu_fx_pass`` (TorchAir's
    name) is an alias of ``fx_passes``."""

    _aliases = {"npu_fx_pass": "fx_passes"}
    fx_passes = Option(False, "joint-graph fusion passes (RMSNorm, rotary, attention)", choices=_BOOL)
    keep_inference_input_mutations = Option(True, "in-place updates of inputs stay in the graph",
                                            choices=_BOOL)
    repeated_regions = Option("auto", "a region the graph repeats (a model's identical layers) is traced and "
                              "compiled once and called for each (graphgear.regions); 'auto': on, except "
                              "in reduce-overhead on the CPU (the CPU graph replays a shared subgraph's "
                              "code slower)", choices=(True, False, "auto"))
    frozen_parameter = Option(False, "parameter addresses are fixed: left out of the graph key "
                              "(each model's parameters still get captures of their own)", choices=_BOOL)
    remove_noop_ops = Option(True, "remove no-op ops (identity views, x+0, x*1, clones)",
                             choices=_BOOL)
    remove_cat_ops = Option(False, "where the graph runs as it is (run_eagerly, device graphs without Inductor): "
                            "the inputs of a cat are written by their ops' out= variants into slices of one "
                            "preallocated output (Inductor does this itself)", choices=_BOOL)
    inplace_pass = Option(True, "the reinplace_intermediates pass: a functional op on a tensor the graph made "
                          "and never reads again becomes its in-place variant, where the graph runs as it is "
                          "(run_eagerly, device graphs without Inductor); False turns it off. No effect where "
                          "Inductor compiles the graph (warns): Inductor re-inplaces it itself, and graphgear "
                          "leaves that on", choices=_BOOL)
    input_inplace_pass = Option(True, "the reinplace_inputs pass: a functional op copied back into a "
                                "graph input becomes its in-place variant on that input", choices=_BOOL)
    static_kernel_compile = Option(False, "TorchAir's static-shape kernel build for Ascend NPUs: accepted, "
                                   "no effect in graphgear (warns once)", choices=_BOOL)
    pattern_fusion_pass = Option(True, "built-in pattern passes and registered replacements",
                                 choices=_BOOL)
    disabled_passes = Option((), "names of FX passes to skip (graphgear.passes.pass_names())",
                             check=_is_names, allowed="a tuple or list of pass names",
                             convert=tuple)  # stored as a tuple: the caller's list stays theirs
    post_grad_custom_pre_pass = Option(None, "user pass fn(gm, example_inputs, config), first",
                                       check=_is_pass, allowed="None or a callable")
    post_grad_custom_post_pass = Option(None, "user pass fn(gm, example_inputs, config), last",
                                        check=_is_pass, allowed="None or a callable")


_MAX_GEARS = 100  # as graphgear.gears.MAX_GEARS


def _input_gears_problem(v: Any) -> str | None:
    """What is wrong with an ``input_gears`` value, or None."""
    if not isinstance(v, Mapping):
        return f"expected a dict {{input name: {{dim: [sizes]}}}}, got a {type(v).__name__}"
    for name, dims in v.items():
        if not isinstance(name, str) or not name:
            return f"input names must be non-empty strings, got {name!r}"
        if not isinstance(dims, Mapping) or not dims:
            return f"the gears of {name!r} must be a non-empty dict {{dim: [sizes]}}, got {dims!r}"
        for dim, sizes in dims.items():
            if not isinstance(dim, int) or isinstance(dim, bool):
                return f"{name!r}: a dim must be an int, got {dim!r}"
            if not isinstance(sizes, list | tuple) or not all(
                isinstance(g, int) and not isinstance(g, bool) and g > 0 for g in sizes
            ):
                return f"{name!r} dim {dim}: gears must be a list of positive ints, got {sizes!r}"
            n = len(set(sizes))
            if not 2 <= n <= _MAX_GEARS:
                return (f"{name!r} dim {dim}: needs 2 to {_MAX_GEARS} distinct sizes, got {n} "
                        f"({sorted(set(sizes))}); for one size leave the dim out")
    return None


def _clean_input_gears(v: Mapping[str, Mapping[int, Any]]) -> dict[str, dict[int, list[int]]]:
    """A copy the caller cannot change afterwards, sizes sorted and distinct."""
    return {name: {dim: sorted(set(sizes)) for dim, sizes in dims.items()} for name, dims in v.items()}


class InferenceConfig(Section):
    """``inference_config``: gears (a fixed set of sizes per dim, one graph each) and gear padding."""

    dynamic_gears_merge_policy = Option("zip", "how gears of several dims combine",
                                        choices=("zip", "product"))
    gear_padding = Option(False, "pad a size up to the next gear, slice outputs back", choices=_BOOL)
    compile_sizes = Option(
        "auto", "sizes compiled specialised, one compile each; every other size of a dynamic graph (each gear, "
        "each shape) takes the graph's one compile with dynamic sizes (reduce-overhead: captured per size). "
        "'auto': none, except in reduce-overhead on the CPU, where every size is specialised (the CPU graph "
        "replays code of static sizes faster)",
        check=lambda v: v in ("all", "auto") or (isinstance(v, tuple | list) and all(_is_int(0)(x) for x in v)),
        convert=lambda v: v if v in ("all", "auto") else tuple(v),
        allowed="a tuple of sizes, e.g. (1, 8), 'all' (every size specialised) or 'auto'")
    input_gears = Option(
        {}, "gears by input name, for inputs the caller does not build (transformers generate())",
        explain=_input_gears_problem, convert=_clean_input_gears,
        allowed="a dict {input name: {dim: [2 to 100 positive sizes]}}, e.g. "
                "{'input_ids': {0: [1, 2, 4]}}; a name matches an input's full name, its last "
                "component ('keys' for cache.layers[0].keys) or a glob ('*keys')",
    )


def _is_pool(v: Any) -> bool:
    return v is None or (isinstance(v, tuple) and len(v) == 2) or hasattr(v, "pool_id")


class CaptureConfig(Section):
    """``capture_config``: capture and replay, in ``reduce-overhead`` mode. ``use_graph_pool`` and
    ``reuse_graph_pool_in_same_fx`` (TorchAir's npugraph_ex names) are aliases of
    ``use_custom_pool`` and ``reuse_pool_across_gears``."""

    _aliases = {"use_graph_pool": "use_custom_pool", "reuse_graph_pool_in_same_fx": "reuse_pool_across_gears"}

    mode = Option("full_and_piecewise", "'full': each graph key is captured whole, or (an op "
                  "that cannot be captured) not at all; 'piecewise': each graph is cut at its "
                  "split nodes (split_ops, and with split_uncapturable the ops a device graph "
                  "cannot hold) and the pieces between them are captured, the split nodes run "
                  "uncaptured between the replays; 'full_and_piecewise': graphs with no split "
                  "node are captured whole, the others in pieces",
                  choices=("full", "piecewise", "full_and_piecewise"))
    split_ops = Option((), "ops the graph is cut at (mode 'piecewise' or 'full_and_piecewise'): "
                       "aten overloads or packets ('aten._scaled_dot_product_flash_attention_for_cpu') "
                       "or custom ops ('mylib::paged_attention'); each runs uncaptured between "
                       "captured pieces, and a Python int only they read is no part of the graph key",
                       check=_is_names, allowed="a tuple or list of op names", explain=split_ops_problem,
                       convert=clean_split_ops)
    split_uncapturable = Option(True, "an op a device graph cannot hold (.item(), a data-dependent "
                                "shape, random numbers on the CPU) becomes a split node instead of "
                                "sending the whole graph to fallback (not in mode 'full')",
                                choices=_BOOL)
    capture_limit = Option(64, "live captured graphs per FX graph; further graph keys run "
                           "uncaptured, with one warning (a piecewise graph counts its pieces)",
                           check=_is_int(1),
                           allowed="an int >= 1")
    clone_input = Option(True, "copy user inputs into static buffers before replay", choices=_BOOL)
    clone_output = Option(False, "return fresh tensors instead of static outputs", choices=_BOOL)
    use_custom_pool = Option(None, "a memory pool shared by several compiled models",
                             check=_is_pool,
                             allowed="None, graphgear.capture.MemoryPool() or a CUDA pool handle")
    reuse_pool_across_gears = Option(True, "the captures of one FX graph share memory",
                                     choices=_BOOL)
    warmup_iters = Option(1, "uncaptured runs of each graph key before it is captured", check=_is_int(0),
                          allowed="an int >= 0")
    fallback = Option("eager", "what a graph that cannot be captured does: 'eager' runs it "
                      "uncaptured (one warning), 'raise' raises graphgear.CaptureError", choices=("eager", "raise"))
    capture_error_mode = Option("thread_local", "the capture_error_mode of CUDA and NPU graph capture: "
                                "'thread_local' (other threads may use the device meanwhile), 'global', 'relaxed' "
                                "(no effect on the CPU graph)", choices=("global", "thread_local", "relaxed"))
    force_recapture = Option(False, "capture again on every call instead of replaying (for bisecting capture "
                             "problems: slow)", choices=_BOOL)


class CompilerConfig(Section):
    """The whole configuration of a graphgear backend.

    >>> config = CompilerConfig()
    >>> config.mode = "reduce-overhead"
    >>> config.capture_config.capture_limit = 16
    """

    mode = Option("max-autotune", "'max-autotune': Inductor compiles the whole graph; 'reduce-overhead': the "
                  "compiled graph is also captured into a device graph (CUDA, NPU, or "
                  "graphgear's CPU graph) and replayed",
                  choices=("max-autotune", "reduce-overhead"))
    debug = DebugConfig
    experimental_config = ExperimentalConfig
    inference_config = InferenceConfig
    capture_config = CaptureConfig

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompilerConfig:
        """Build a config from ``as_dict()`` output (nested) or from option paths."""
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"graphgear: CompilerConfig.from_dict(data) takes a dict (as_dict() output, or option "
                f"paths to values), got {type(data).__name__} {reprlib.repr(data)}. Pass a dict, e.g. "
                f"{{'mode': 'reduce-overhead'}}."
            )
        config = cls()
        nested = {k: v for k, v in data.items() if "." not in k}
        config._load(nested)
        apply_options(config, {k: v for k, v in data.items() if "." in k})
        return config

    @classmethod
    def option_paths(cls) -> dict[str, Option]:
        """Every leaf option by its dotted path."""
        out: dict[str, Option] = {}

        def walk(section: type[Section], prefix: str) -> None:
            for name, opt in section._options().items():
                out[prefix + name] = opt
            for name, sub in section._sections().items():
                walk(sub, f"{prefix}{name}.")

        walk(cls, "")
        return out


#: ``options=`` keys naming an option by TorchAir's name (its ``npugraph_ex`` options; see
#: docs/guides/coming-from-torchair.md) -> the graphgear option's dotted path.
OPTION_ALIASES: Mapping[str, str] = {
    "npu_fx_pass": "experimental_config.fx_passes",
    "force_eager": "debug.run_eagerly",
    "use_graph_pool": "capture_config.use_custom_pool",
    "reuse_graph_pool_in_same_fx": "capture_config.reuse_pool_across_gears",
    "dump_tensor_data": "debug.data_dump.enabled",
    "data_dump_stage": "debug.data_dump.stage",
    "data_dump_dir": "debug.data_dump.path",
}


def _section_aliases() -> dict[str, str]:
    """``section.alias`` -> ``section.option`` for every section's ``_aliases``."""
    out, todo = {}, [("", CompilerConfig)]
    while todo:
        prefix, section = todo.pop()
        out.update({prefix + a: prefix + t for a, t in section._aliases.items()})
        todo += [(f"{prefix}{name}.", sub) for name, sub in section._sections().items()]
    return out


def _resolve_key(key: str) -> str:
    paths = CompilerConfig.option_paths()
    if key in paths:
        return key
    if key in OPTION_ALIASES:
        return OPTION_ALIASES[key]
    aliases = _section_aliases()
    if key in aliases:
        return aliases[key]
    leaf_matches = [p for p in paths if p.rsplit(".", 1)[-1] == key]
    if len(leaf_matches) == 1:
        return leaf_matches[0]
    if len(leaf_matches) > 1:
        raise ConfigError(
            f"graphgear: option {key!r} is ambiguous; use its full path, one of: "
            f"{', '.join(sorted(leaf_matches))}."
        )
    unique_leaves = sorted(
        leaf for leaf in {p.rsplit(".", 1)[-1] for p in paths}
        if sum(p.rsplit(".", 1)[-1] == leaf for p in paths) == 1
    )
    targets = {leaf: p for p in paths for leaf in unique_leaves if p.rsplit(".", 1)[-1] == leaf}
    targets |= {a: f"TorchAir's name of {t}" for a, t in {**aliases, **OPTION_ALIASES}.items()}
    raise ConfigError(
        f"graphgear: unknown option {key!r}.{did_you_mean(key, [*paths, *targets], targets)} Known "
        f"options: {', '.join(sorted(paths))} (unique leaf names also work: {', '.join(unique_leaves)}; "
        f"so do TorchAir's names: {', '.join(sorted(OPTION_ALIASES))})."
    )


def check_options(options: Any) -> None:
    """Raise :class:`ConfigError` unless ``options`` is None or a mapping (what
    ``torch.compile(options=...)`` and :func:`apply_options` take)."""
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(
            f"graphgear: options= must be a dict of option names to values, e.g. "
            f"{{'mode': 'reduce-overhead', 'capture_limit': 16}}, got {type(options).__name__} "
            f"{reprlib.repr(options)}. Pass a dict (dict(pairs) for a list of (name, value) pairs)."
        )


def apply_options(config: CompilerConfig, options: Mapping[str, Any] | None) -> CompilerConfig:
    """Apply ``torch.compile(options=...)`` style keys (dotted paths or unique leaves)."""
    check_options(options)
    for key, value in (options or {}).items():
        if not isinstance(key, str):
            raise ConfigError(f"graphgear: option names are strings, got {key!r}.")
        path = _resolve_key(key)
        section: Any = config
        *parents, leaf = path.split(".")
        for p in parents:
            section = getattr(section, p)
        setattr(section, leaf, value)
    return config


def mode_of(config: CompilerConfig) -> str:
    """The compiler that runs: ``eager`` under ``debug.run_eagerly``, else ``config.mode``."""
    return "eager" if config.debug.run_eagerly else config.mode

"""``max-autotune``: hand the whole graph to Inductor.

:func:`compile_inductor` compiles one aten graph (forward, backward or inference), after
graphgear's passes, with Inductor's graph compiler (``compile_fx_inner``). It compiles
the graph as given: a dynamic graph once for all its sizes, a static graph (one gear,
as the gear dispatcher hands it) for that size. Inductor's on-disk cache
(``TORCHINDUCTOR_CACHE_DIR``) makes a second process's compile of the same graph fast;
its key is tagged with ``graphgear.passes.PASSES_VERSION`` (:func:`cache_context`, which
the CPU graph's compile uses too).

The fusion passes leave fused ops Inductor can only call as extern kernels
(``graphgear::rotary_rotate_half``, ``aten._fused_rms_norm``); they are inlined back
into aten ops first, so Inductor fuses them with their neighbours into generated code.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from .._torch.aot import boxed_convention, count_tangents
from .._torch.fx import FakeTensor, FakeTensorMode, TracingContext, pytree, tracing, unset_fake_temporarily
from .._torch.inductor import (
    inductor_compile_fx_inner,
    inductor_config_patch,
    inductor_donated_buffers,
    inductor_drop_args,
    inductor_mark_frozen,
    inductor_unlist_module,
)
from .._torch.inductor_passes import inductor_decomp_table, inductor_replace_random
from ..cache.artifacts import KeyArtifact, strip_cache_tag
from ..config import CompilerConfig
from ..context import CompileContext
from ..cpu import kernels
from ..cpu.frozen import FrozenCopies
from ..cpu.passes import PackFrozenLinears, frozen_passes, unfrozen_passes
from ..passes import PASSES_VERSION
from ..passes.manager import PassManager
from ..passes.ops import inductor_fused_op_decompositions, inline_decompositions, register_inductor_lowering
from ..stats import GraphRecord

log = logging.getLogger(__name__)

__all__ = ["cache_context", "compile_dynamic", "compile_inductor", "compile_static", "decompose_static",
           "inductor_decompositions", "static_fakes"]

# max-autotune sets no Inductor option of its own: freezing, cpp_wrapper and max_autotune's
# CPP GEMM were all within the noise on the embedded decoder step (benchmarks/
# bench_max_autotune.py --patches; the figures: benchmarks/RESULTS.md,
# "bench_max_autotune.py history"), and freezing would bake parameters in, wrong for
# training.


def inductor_decompositions() -> dict[Any, Any]:
    """Inductor's own decomposition table (it leaves out the entries that break
    attention gradients on the CPU)."""
    return dict(inductor_decomp_table())


def cache_context(example_inputs: Sequence[Any], *, replace: bool = False) -> contextlib.ExitStack:
    """The context an Inductor compile of graphgear's runs in, so that the FX graph
    cache serves it: its key tagged with ``PASSES_VERSION``, and a tracing context whose
    fake mode has a shape env (without one Inductor bypasses the cache).

    Inside AOTAutograd's compile the active tracing context is kept (it carries the
    graph's metadata) unless ``replace``, or unless its fake mode is not the example
    inputs' (a graph rebuilt from the compile cache, compiled while torch loads the
    entry: Inductor would mix the two modes); at run time (a gear or a capture built on
    its first call) a fresh one is made from the example inputs' fake mode.
    """
    stack = contextlib.ExitStack()
    base = strip_cache_tag(torch.compiler.config.cache_key_tag)  # not the compile cache's entry tag
    tag = f"{base}graphgear-passes-v{PASSES_VERSION}"
    fake_mode = next((a.fake_mode for a in example_inputs if isinstance(a, FakeTensor)), None)
    active = TracingContext.try_get()
    inside = not replace and active is not None
    keep = inside and (fake_mode is None or active.fake_mode is fake_mode)
    donated = inductor_donated_buffers() if inside else None
    if donated is not None:
        # a backward that may overwrite saved activations (plain backward()) and one that
        # may not (retain_graph=True) are different code; Inductor's key cannot tell
        tag += f"-donated-{','.join(map(str, donated))}"
    stack.enter_context(torch.compiler.config.patch(cache_key_tag=tag))
    if not keep:
        stack.enter_context(tracing(TracingContext(fake_mode)))
    return stack


def prepare_for_inductor(gm: fx.GraphModule) -> int:
    """Inline the fused ops Inductor would run as extern kernels; returns how many."""
    return inline_decompositions(gm, inductor_fused_op_decompositions())


def compile_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], ctx: CompileContext) -> Callable[..., Any]:
    """Compile ``gm`` with Inductor's graph compiler; returns Inductor's boxed callable.

    The gear dispatcher calls this with the graph and its symbolic sizes, once for all
    gears, or with a static graph per size ``inference_config.compile_sizes`` names. ``ctx.loaded`` (the compile cache):
    that key's stored compiled graph, run instead of compiling; with ``ctx.artifacts``
    and ``ctx.key`` the compiled graph is recorded there.
    """
    loaded: KeyArtifact | None = ctx.loaded
    register_inductor_lowering()
    kernels.register_lowerings()
    if loaded is not None:
        return _unflattening(loaded.code, pytree.treespec_loads(loaded.spec) if loaded.spec else None)
    spec = _return_tuple(gm)
    if ctx.stage == "inference":  # (an op without a backward: inference graphs only)
        PassManager(unfrozen_passes()).run(gm, example_inputs, ctx.config, ctx.record)
    inlined = prepare_for_inductor(gm)
    inductor_replace_random(gm, example_inputs)  # as compile_fx does before compile_fx_inner
    if inlined:
        log.debug("graphgear: inlined %d fused ops for Inductor in %s", inlined, ctx.record.name)
        ctx.record.passes["inline_fused_ops"] = ctx.record.passes.get("inline_fused_ops", 0) + inlined
    static = list(ctx.static_inputs)
    if ctx.stage == "backward":
        # as Inductor's bw_compiler: the saved activations before the tangents are fixed
        static = list(range(count_tangents(gm)))
    with cache_context(example_inputs):
        compiled = inductor_compile_fx_inner(
            gm,
            list(example_inputs),
            static_input_idxs=static,
            is_inference=ctx.stage == "inference",
            is_backward=ctx.stage == "backward",
        )
    if ctx.artifacts is not None and ctx.key is not None:
        ctx.artifacts.record(ctx.key, "inductor", compiled,
                             spec=pytree.treespec_dumps(spec) if spec is not None else None)
    return _unflattening(compiled, spec)


def _unflattening(compiled: Callable[..., Any], spec: Any) -> Callable[..., Any]:
    """``compiled`` (flat outputs), returning them nested as ``spec`` says (None: flat)."""
    if spec is None:
        return compiled

    @boxed_convention
    def unflatten(args: list[Any]) -> Any:
        return pytree.tree_unflatten(list(compiled(args)), spec)

    return unflatten


def _return_tuple(gm: fx.GraphModule) -> Any:
    """Inductor compiles graphs that return a tuple or list; make ``gm`` return its
    outputs flattened. Returns the pytree spec to rebuild them, None if already flat."""
    out = next(iter(gm.graph.find_nodes(op="output")))
    (rv,) = out.args
    if isinstance(rv, tuple | list) and all(not isinstance(x, tuple | list | dict) for x in rv):
        return None
    flat, spec = pytree.tree_flatten(rv)
    with gm.graph.inserting_before(out):
        gm.graph.output(flat)
    gm.graph.erase_node(out)
    gm.recompile()
    return spec


def decompose_static(gm: fx.GraphModule, args: Sequence[Any]) -> fx.GraphModule:
    """``gm`` re-traced with Inductor's decompositions at the sizes of ``args`` (fake
    tensors of one fake mode: inputs are not touched)."""
    fake_mode = next(a.fake_mode for a in args if isinstance(a, FakeTensor))
    with unset_fake_temporarily(), tracing(None), fake_mode:
        return make_fx(gm, decomposition_table=inductor_decomp_table(), tracing_mode="real",
                       record_module_stack=False)(*args)


def static_fakes(args: Sequence[Any], *, allow_constants: bool = False) -> list[Any]:
    """Fake copies of ``args`` (static shapes) in a fake mode with a shape env, which
    Inductor's FX graph cache needs to serve a compile; ``allow_constants``: the graph
    holds real tensors as constants (frozen parameters)."""
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=allow_constants)
    with unset_fake_temporarily():
        return [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a
                for a in args]


#: The C++ wrapper for a frozen static graph with at least this many packed products
#: (each an extern kernel call that the Python wrapper makes through torch's dispatcher,
#: a few microseconds apiece with the caches cold after the product before it): faster
#: in bench_decode's small Qwen2 served step with its packed products. Without packed
#: products (batch 1: one generated kernel) the C++ wrapper was slower (it converts every
#: argument and allocates in C++, and the CPU graph then copies the outputs), so the
#: Python wrapper and its allocation record stay there (benchmarks/bench_decode.py; the
#: figures: benchmarks/RESULTS.md, "bench_decode.py history").
CPP_WRAPPER_MIN_EXTERN_CALLS = 4


def compile_static(
    gm: fx.GraphModule, args: Sequence[Any], *, stage: str, static_idx: Sequence[int],
    frozen: bool = False, copies: FrozenCopies | None = None,
    config: CompilerConfig | None = None, record: GraphRecord | None = None,
) -> Callable[[list[Any]], Any]:
    """Inductor-compile a static-shape graph for a device graph to capture (the CPU
    graph records its allocations; a CUDA graph captures its kernels); boxed callable.

    ``frozen`` (``experimental_config.frozen_parameter`` on an inference graph on the
    CPU): the static inputs that are parameters become constants of the graph, so the
    weights are packed once at compile time and every small-M matrix product is served
    from them (a decode step at batch 2 to 8: ATen's small-M GEMM reads weights at a
    fraction of the one-row rate). Buffers and static-address inputs (a
    KV cache's write position) stay inputs: they are state that may change between
    replays. The compiled code holds a packed copy: parameters changed in place
    afterwards are not seen. That is what ``frozen_parameter`` promises.

    On the CPU the products go where :mod:`graphgear.cpu.passes` sends them, its passes
    run in order by a :class:`~graphgear.passes.manager.PassManager` with ``config``
    (its ``disabled_passes``, its ``debug.graph_dump``) and counted in ``record``: frozen,
    products of 2 to 16 rows to graphgear's own packed product
    (:mod:`graphgear.cpu.kernels.small_gemm_kernel`; where the graph's weights of such
    products outgrow the last-level cache, to graphgear's row-major product on the frozen
    weights themselves instead: no grouped or packed copy), those of up to 64 rows (or
    where that kernel cannot be built) to MKL's packed GEMM (products of the same rows
    grouped into one first); one-row products are Inductor's decomposed reductions
    (``decompose_mm_pass``), except those with a weight too wide for it, which go to
    graphgear's row-major product on the weight, unpacked; products of more rows
    Inductor's C++ GEMM template. Not frozen (an inference graph), products of up to 16
    rows read the weights as they lie, by graphgear's row-major product. A graph with at
    least :data:`CPP_WRAPPER_MIN_EXTERN_CALLS` MKL products and no call of graphgear's
    kernels (:mod:`graphgear.cpu.kernels`) is compiled with Inductor's C++ wrapper (the
    CPU graph then copies its outputs to static buffers).
    """
    register_inductor_lowering()
    kernels.register_lowerings()
    frozen = frozen and bool(static_idx)
    fakes = static_fakes(args, allow_constants=frozen)
    dgm = decompose_static(gm, fakes)
    patches: dict[str, Any] = dict(
        post_grad_fusion_options={"decompose_mm_pass": {}}, freezing=False,
        # the CPU graph records allocations through the Python wrapper's allocator
        # (the C++ wrapper only for packed products: see below)
        cpp_wrapper=False,
        # inputs are bound at capture: their sizes and strides cannot change
        size_asserts=False, alignment_asserts=False,
    )
    keep = list(range(len(args)))
    static = list(static_idx)
    cpp_wrapper = False
    if frozen:
        params = [i for i in static if isinstance(args[i], torch.nn.Parameter)]
        keep = _freeze_inputs(dgm, args, params)
        fakes = [fakes[i] for i in keep]
        static = [keep.index(i) for i in static if i in keep]
        # frozen is CPU-only; it packs CPU fp32 weights only. graphgear's kernels (its
        # product, its decode attention) are Python-level extern kernels (the CPU graph
        # calls them directly): the C++ wrapper is for graphs of MKL's products only
        counts: dict[str, int] = {}
        _cpu_passes(frozen_passes(dgm, copies), dgm, fakes, config, record, counts)
        mkl_products = counts.get(PackFrozenLinears.name, 0)
        cpp_wrapper = mkl_products >= CPP_WRAPPER_MIN_EXTERN_CALLS and not kernels.calls_in(dgm)
        # products left: Inductor's C++ GEMM template for those of more rows than MKL's
        # packing takes; one-row ones stay Inductor's fused loops (those too wide for
        # them are graphgear's products already)
        if _rows_left(dgm) > 1:
            patches.update(max_autotune=True, max_autotune_gemm_backends="CPP")
        _drop_unused_constants(dgm)
        # the weights (and their packed copies) are constants now: Inductor's cache keys
        # them by shape, not by value, and takes their values from this module
        inductor_mark_frozen(dgm, [n for n, _ in dgm.named_buffers() if n.startswith("_graphgear_")])
    elif stage == "inference":
        # weights passed in (they may change): small-M products read them as they lie
        _cpu_passes(unfrozen_passes(), dgm, fakes, config, record, {})
    patches["cpp_wrapper"] = cpp_wrapper
    inductor_replace_random(dgm, fakes)
    with cache_context(fakes, replace=True), inductor_config_patch(**patches):
        compiled = inductor_compile_fx_inner(
            dgm, fakes, static_input_idxs=static,
            is_inference=stage == "inference", is_backward=stage == "backward",
            cpp_wrapper=cpp_wrapper,
        )
    if frozen:
        # its module holds the weights: it lives as long as this code, not the process
        inductor_unlist_module(compiled)
    if len(keep) == len(args):
        return compiled
    return inductor_drop_args(compiled, keep)


def compile_dynamic(
    gm: fx.GraphModule, args: Sequence[Any], *, stage: str, static_idx: Sequence[int],
    config: CompilerConfig | None = None, record: GraphRecord | None = None,
) -> Callable[[list[Any]], Any]:
    """Inductor-compile a graph with symbolic sizes once, for the device graph of every
    size (reduce-overhead's shared compile): ``args`` are its fake example inputs, with
    their symbolic sizes. As :func:`compile_static` without frozen weights: each capture
    binds the inputs, so the code asserts no sizes; boxed callable."""
    register_inductor_lowering()
    kernels.register_lowerings()
    fakes = list(args)
    dgm = decompose_static(gm, fakes)
    if stage == "inference":
        _cpu_passes(unfrozen_passes(), dgm, fakes, config, record, {})
    inductor_replace_random(dgm, fakes)
    patches: dict[str, Any] = dict(post_grad_fusion_options={"decompose_mm_pass": {}}, freezing=False,
                                   cpp_wrapper=False, size_asserts=False, alignment_asserts=False)
    with cache_context(fakes, replace=True), inductor_config_patch(**patches):
        return inductor_compile_fx_inner(dgm, fakes, static_input_idxs=list(static_idx),
                                         is_inference=stage == "inference", is_backward=stage == "backward",
                                         cpp_wrapper=False)


def _cpu_passes(passes: Sequence[Any], gm: fx.GraphModule, fakes: Sequence[Any], config: CompilerConfig | None,
                record: GraphRecord | None, counts: dict[str, int]) -> None:
    """Run the CPU passes ``passes`` on ``gm`` (a default config where none is given:
    nothing disabled, no dump), adding their changes to ``counts`` and ``record``."""
    PassManager(passes).run(gm, fakes, config if config is not None else CompilerConfig(), record, counts=counts)


def _drop_unused_constants(gm: fx.GraphModule) -> None:
    """Delete the constants graphgear made that no node reads any more (a concatenated
    weight once packed): Inductor's code for frozen constants keeps ``gm`` alive, and with
    it every tensor attribute."""
    used = {str(n.target) for n in gm.graph.find_nodes(op="get_attr")}
    for name in [n for n, _ in gm.named_buffers() if n.startswith("_graphgear_") and n not in used]:
        delattr(gm, name)


def _rows_left(gm: fx.GraphModule) -> int:
    """The most rows of a matrix product (``mm``/``addmm``) left in ``gm`` (0: none)."""
    rows = 0
    for op, x_at in ((torch.ops.aten.mm.default, 0), (torch.ops.aten.addmm.default, 1)):
        for node in gm.graph.find_nodes(op="call_function", target=op):
            xv = node.args[x_at].meta.get("val") if isinstance(node.args[x_at], fx.Node) else None
            m = xv.shape[0] if isinstance(xv, torch.Tensor) and xv.dim() == 2 else None
            rows = max(rows, m if isinstance(m, int) else 2)  # unknown: as if several
    return rows


def _freeze_inputs(gm: fx.GraphModule, args: Sequence[Any], frozen: Sequence[int]) -> list[int]:
    """Turn the placeholders at ``frozen`` into constants holding ``args``' tensors;
    returns the positions of the inputs that remain."""
    phs = list(gm.graph.find_nodes(op="placeholder"))
    with gm.graph.inserting_after(phs[-1]):
        for i in sorted(frozen, reverse=True):
            name = f"_graphgear_frozen_{i}"
            gm.register_buffer(name, args[i].detach())
            const = gm.graph.get_attr(name)
            const.meta = dict(phs[i].meta)
            phs[i].replace_all_uses_with(const)
            gm.graph.erase_node(phs[i])
    gm.recompile()
    gone = set(frozen)
    return [i for i in range(len(args)) if i not in gone]

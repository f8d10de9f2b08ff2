"""Inductor's compiler (``torch._inductor``): ``compile_fx_inner``, its config, the
donated buffers of a backward, frozen-parameter marks, its lowering table and extern
kernels, its C++ build of a kernel, Triton's presence, and access to the code it
generates (the generated module's globals, its wrapper's names, its ``Runner.call``).

Checked on 2.13 (CPU build) and 2.14.1 (2.11 to 2.14 where a note says so). Every
function imports ``torch._inductor`` lazily: it is heavy, and run_eagerly never needs it.
If these moved, max-autotune and the CPU/CUDA graphs' native code would not compile,
graphgear's kernels would not build, and the CPU graph would run Inductor's generated
``call`` on every replay instead of its kernel calls (slower, never wrong); each wrapper
has its note. Reading the generated ``call`` as code is
``graphgear.capture.program``'s; what it needs of the generated module it gets from
:func:`inductor_generated_call` here.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import sys
import textwrap
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = [
    "INDUCTOR_ALLOC_NAMES",
    "INDUCTOR_CHECK_NAMES",
    "INDUCTOR_CPP_WRAPPER_NAMES",
    "INDUCTOR_EXTERN_KERNELS",
    "INDUCTOR_VIEW_NAME",
    "GeneratedCall",
    "has_triton",
    "inductor_callable",
    "inductor_compile_fx_inner",
    "inductor_config_patch",
    "inductor_donated_buffers",
    "inductor_drop_args",
    "inductor_generated_call",
    "inductor_is_cpp_wrapper",
    "inductor_load_cpp_kernel",
    "inductor_lowering",
    "inductor_mark_frozen",
    "inductor_unlist_module",
    "inductor_wrapper_globals",
    "is_generated_kernel",
    "register_inductor_extern_out",
]


def inductor_compile_fx_inner(gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
    """Inductor's graph compiler on one aten graph; returns its boxed compiled graph.

    ``torch._inductor.compile_fx.compile_fx_inner`` (keywords ``static_input_idxs``,
    ``is_inference``, ``is_backward``): checked on 2.13; ``compile_fx`` calls it so in
    2.13. If it moved or its keywords changed, max-autotune and the CPU/CUDA graphs'
    native code would not compile."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, **kwargs)


def inductor_donated_buffers() -> list[int] | None:
    """The saved activations Inductor may overwrite in the backward graph it compiles now
    (AOTAutograd's ``bw_donated_idxs`` on the active tracing context's ``fw_metadata``;
    ``[]`` for a backward run with ``retain_graph=True``), None where no context says.

    Inductor reads it while compiling (``GraphLowering.bw_donated_idxs``), but its FX
    graph cache key leaves it out: a backward compiled for a plain ``backward()`` (which
    reuses saved activations' memory) would be served to a ``retain_graph=True`` one,
    whose second backward then reads overwritten activations (wrong gradients).
    graphgear puts it into its cache key tag (``compilers.inductor.cache_context``).
    ``torch._inductor.utils.get_donated_idxs``: checked on 2.13 (2.11 to 2.14). If it
    went, this returns None and the tag cannot tell the two apart."""
    try:
        from torch._inductor.utils import get_donated_idxs
    except ImportError:
        return None
    idxs = get_donated_idxs()
    return None if idxs is None else list(idxs)


def inductor_config_patch(**changes: Any) -> Any:
    """A context manager setting Inductor options (``torch._inductor.config.patch``).

    Checked on 2.13 for the options graphgear sets (``post_grad_fusion_options``,
    ``freezing``, ``cpp_wrapper``, ``size_asserts``, ``alignment_asserts``). If one went,
    ``patch`` raises and the static compile of the CPU/CUDA graphs fails."""
    from torch._inductor import config as inductor_config

    return inductor_config.patch(**changes)


def inductor_mark_frozen(gm: torch.fx.GraphModule, names: Sequence[str]) -> None:
    """Mark ``gm``'s buffers ``names`` as frozen parameters, as Inductor's own
    ``freezing`` marks the weights it folds into a graph.

    Inductor's FX graph cache then keys such a constant by its metadata (shape, dtype,
    strides) instead of its values (``FxGraphCachePickler._reduce_tensor``, which
    otherwise calls ``tolist()`` on every constant: 128 of 151 s of the first request of
    a 2-layer Qwen2-0.5B-wide model, vocabulary 151936), and the cache entry holds the
    constants' names, not their values: a compiled graph loaded from the cache (another
    model of the same shapes, or a later process) takes them from ``gm``
    (``CompiledFxGraphConstantsWithGm``).

    A 0-d constant is left unmarked: Inductor writes its value into the generated code
    (``GraphLowering.get_attr``: ``Constant(value.item())``) while the cache would key a
    marked one by metadata only (``can_inline_constant`` says False for 0-d), so another
    model's scalar (a learnt temperature, a scale) would be served from the code of the
    first; unmarked, it is hashed by value.

    ``torch._inductor.freezing_utils`` (``record_has_frozen_params``, the tensor
    attribute ``_is_frozen_param``): 2.13, in 2.11 to 2.14. If it moved, nothing is
    marked: constants are hashed by value (slow for large weights, still right)."""
    try:
        from torch._inductor.freezing_utils import record_has_frozen_params
    except ImportError:
        return
    for name in names:
        t = getattr(gm, name)
        if t.dim() == 0:
            continue
        t._is_frozen_param = True  # type: ignore[attr-defined]
    record_has_frozen_params(gm)


def inductor_lowering() -> Any:
    """The module ``torch._inductor.lowering`` (``lowerings``, ``fallbacks``,
    ``register_lowering``).

    Checked on 2.13 (2.11 to 2.14 have all three names). If it changed, the rotary op
    would run as an extern kernel under Inductor and the op summary would not say which
    ops Inductor lowers; callers catch the failure."""
    from torch._inductor import lowering

    return lowering


def inductor_load_cpp_kernel(argtypes: Sequence[str], source: str) -> Callable[..., None]:
    """Build ``source`` (C++ defining ``extern "C" void kernel(...)`` with ``argtypes``,
    such as ``"const float*"`` or ``"const int64_t"``) with Inductor's compiler, flags and
    vector ISA into a built-in ``kernel`` taking tensors (their data pointers) and ints,
    as Inductor builds its own C++ kernels (cached in Inductor's cache folder).

    ``CppPythonBindingsCodeCache.load_pybinding(argtypes, code, needs_vec_isa=True)``:
    checked on 2.13 and 2.14 (2.11 has no ``needs_vec_isa``: then the kernel is built
    without the ISA flags, its portable loop; still right). Raises whatever the build
    raises (no compiler: the caller falls back)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    try:
        return CppPythonBindingsCodeCache.load_pybinding(list(argtypes), source, needs_vec_isa=True)
    except TypeError:
        return CppPythonBindingsCodeCache.load_pybinding(list(argtypes), source)


def register_inductor_extern_out(target: Any, fn: Callable[..., Any], name: str,
                                 out_size: Callable[..., list[Any]],
                                 call_kwargs: Callable[..., dict[str, Any]] | None = None) -> bool:
    """Give Inductor a lowering for the custom op ``target`` (tensor arguments first,
    then scalars; a None tensor is left out): an extern kernel writing into a buffer
    Inductor allocates, called as ``extern_kernels.<name>(*tensors, **kwargs, out=buf)``
    from the generated code (what the CPU graph's kernel-call replay reads).
    ``out_size(*sizes, *scalars)`` gives the buffer's size (contiguous fp32 on the first
    tensor's device); ``call_kwargs(*scalars)`` the scalars passed to the call as
    keywords (none by default: the scalars then go to ``out_size`` only). Returns False
    where Inductor already has one (registered once per process: the lowering table and
    ``extern_kernels`` are Inductor's own registries).

    ``select_algorithm.ExternKernelChoice(fn, name=...)`` (puts ``fn`` on
    ``extern_kernels``), ``.bind(inputs, layout, **kwargs).output_node()`` (an
    ``ir.ExternKernelOut``), ``ir.FixedLayout``, ``ir.ExternKernel.require_contiguous``,
    ``lowering.register_lowering``: checked on 2.13 and 2.14."""
    from torch._inductor import ir, lowering
    from torch._inductor.select_algorithm import ExternKernelChoice

    if target in lowering.lowerings:
        return False
    choice = ExternKernelChoice.lookup(name) or ExternKernelChoice(fn, name=name)

    @lowering.register_lowering(target, type_promotion_kind=None)
    def _lower(*args: Any) -> Any:
        tensors = [ir.ExternKernel.require_contiguous(a) for a in args if isinstance(a, ir.TensorBox)]
        scalars = [a for a in args if not isinstance(a, ir.TensorBox) and a is not None]
        size = out_size(*[list(t.get_size()) for t in tensors], *scalars)
        layout = ir.FixedLayout(tensors[0].get_device(), torch.float32, size)
        kwargs = call_kwargs(*scalars) if call_kwargs is not None else {}
        return choice.bind(tensors, layout, **kwargs).output_node()

    return True


def has_triton() -> bool:
    """Whether Triton is importable and usable by Inductor.

    ``torch.utils._triton.has_triton``: checked on 2.13 (False on the CPU build); Inductor's
    scheduler checks it in 2.13. If it moved the call raises; the
    caller then takes Triton as missing and the CUDA graph captures the FX graph."""
    from torch.utils._triton import has_triton as triton

    return bool(triton())


#: Inductor's name for the allocator in its generated Python wrapper (a global of the
#: generated module): checked on 2.13 (the CPU wrapper's ``empty_strided_cpu``). If it
#: is renamed the CPU graph says so in a warning and runs without its allocation record.
INDUCTOR_ALLOC_NAMES = ("empty_strided_cpu",)


def inductor_callable(compiled: Any) -> Callable[[list[Any]], Any]:
    """The boxed callable of Inductor's compiled graph: its generated ``call`` where it
    has one (``CompiledFxGraph.current_callable``, checked on 2.13), else ``compiled``."""
    return getattr(compiled, "current_callable", None) or compiled


#: Names in the module of Inductor's C++ wrapper (``cpp_wrapper``), whose ``call`` hands
#: the inputs to compiled C++ that allocates its buffers itself: checked on 2.13 (the
#: generated module defines ``cpp_wrapper_src`` and ``inductor_entry``).
INDUCTOR_CPP_WRAPPER_NAMES = ("cpp_wrapper_src", "inductor_entry")


def _generated_globals(compiled: Any, names: Sequence[str]) -> dict[str, Any] | None:
    fn = getattr(compiled, "current_callable", None)
    seen = 0
    while fn is not None and seen < 5:
        g = getattr(fn, "__globals__", None)
        if g is not None and any(n in g for n in names):
            return g
        fn = getattr(fn, "__wrapped__", None) or getattr(fn, "func", None)
        seen += 1
    return None


def inductor_wrapper_globals(compiled: Any) -> dict[str, Any] | None:
    """The globals of Inductor's generated ``call`` function (where its allocator is),
    None where none of :data:`INDUCTOR_ALLOC_NAMES` is found.

    Follows ``CompiledFxGraph.current_callable`` and up to five ``__wrapped__`` /
    ``func`` links: checked on 2.13. If Inductor changes its wrapper the CPU graph warns
    and runs the native code without a record."""
    return _generated_globals(compiled, INDUCTOR_ALLOC_NAMES)


def inductor_unlist_module(compiled: Any) -> bool:
    """Drop Inductor's process-long references to the generated module of ``compiled``
    (a graph whose code holds frozen constants), so that the module, and the weights it
    holds, live as long as ``compiled``'s code and no longer; False where the module is
    not found (nothing dropped).

    ``PyCodeCache.load_by_key_path`` (2.13) loads a module with attributes (the frozen
    constants, ``CompiledFxGraphConstantsWithGm``) afresh each time, appends it to
    ``PyCodeCache.modules`` (a list Inductor itself prunes only around autotuning) and
    puts it in ``sys.modules``: a served model deleted and ``graphgear.reset()`` left
    about twice its weights alive per model. The list serves Inductor's profiler and
    benchmark helpers only."""
    g = _generated_globals(compiled, INDUCTOR_ALLOC_NAMES + INDUCTOR_CPP_WRAPPER_NAMES)
    if g is None:
        return False
    try:
        from torch._inductor.codecache import PyCodeCache
    except ImportError:
        return False
    PyCodeCache.modules[:] = [m for m in PyCodeCache.modules if m.__dict__ is not g]
    name = g.get("__name__")
    mod = sys.modules.get(name) if isinstance(name, str) else None
    if mod is not None and mod.__dict__ is g:
        del sys.modules[name]
    return True


def inductor_is_cpp_wrapper(compiled: Any) -> bool:
    """Whether Inductor's compiled graph runs through its C++ wrapper (``cpp_wrapper``):
    its buffers are allocated in C++, out of the Python allocator's reach (the same
    links as :func:`inductor_wrapper_globals`, names :data:`INDUCTOR_CPP_WRAPPER_NAMES`;
    checked on 2.13)."""
    return _generated_globals(compiled, INDUCTOR_CPP_WRAPPER_NAMES) is not None


def inductor_drop_args(compiled: Any, keep: list[int]) -> Any:
    """Inductor's compiled graph called with more inputs than it takes: only those at
    ``keep`` are passed on (the others became constants of the graph, frozen
    parameters). Looks like the compiled graph to :func:`inductor_callable` and
    :func:`inductor_wrapper_globals` (a ``current_callable`` whose ``__wrapped__`` is
    Inductor's generated ``call``: checked on 2.13)."""
    inner = inductor_callable(compiled)

    @functools.wraps(inner)
    def call(args: list[Any]) -> Any:
        return inner([args[i] for i in keep])

    call.graphgear_keep = tuple(keep)  # type: ignore[attr-defined]  # read by inductor_generated_call

    class _Compiled:
        current_callable = staticmethod(call)

        def __call__(self, args: list[Any]) -> Any:
            return call(args)

    return _Compiled()


#: Names of Inductor's generated Python wrapper that its ``Runner.call`` uses, as
#: ``graphgear.capture.program`` reads it: the view helper, the namespace of the extern
#: kernels (ATen's and graphgear's) and the argument checks; checked on 2.13
#: (``reinterpret_tensor``, ``extern_kernels``, ``assert_size_stride``,
#: ``assert_alignment``). If Inductor renames one, the reader meets a statement it does
#: not know and the CPU graph runs the generated ``call`` itself (as fast as before,
#: never wrong).
INDUCTOR_VIEW_NAME = "reinterpret_tensor"
INDUCTOR_EXTERN_KERNELS = "extern_kernels"
INDUCTOR_CHECK_NAMES = ("assert_size_stride", "assert_alignment")


def is_generated_kernel(fn: Any) -> bool:
    """A C++ kernel of Inductor's Python wrapper: ``async_compile.cpp_pybinding`` loads
    each as a built-in function named ``kernel`` of an extension module of its own
    (checked on 2.13)."""
    return isinstance(fn, types.BuiltinFunctionType) and fn.__name__ == "kernel"


@dataclasses.dataclass(frozen=True)
class GeneratedCall:
    """Inductor's generated Python ``call`` of a compiled graph, found by
    :func:`inductor_generated_call`: ``source``, the dedented source of the generated
    module's ``Runner.call``; ``names``, the generated module's globals (read-only), by
    which the names in that source resolve; ``keep``, the indices of the caller's
    arguments passed on (:func:`inductor_drop_args`), or None for all."""

    keep: tuple[int, ...] | None
    source: str
    names: Mapping[str, Any]


def inductor_generated_call(compiled: Any) -> GeneratedCall | None:
    """The generated Python ``call`` that Inductor's compiled graph ``compiled`` runs, or
    None where it runs anything else (a C++ wrapper, another wrapper Inductor put around
    it, such as the copy of misaligned inputs, which must keep running) or its source
    cannot be read.

    The generated ``call`` itself, or graphgear's argument dropping around it
    (:func:`inductor_drop_args`), must be ``compiled``'s ``current_callable``; its
    module's ``Runner.call`` is read with ``inspect`` (Inductor writes the module to its
    cache folder). The same links as :func:`inductor_wrapper_globals`; checked on 2.13.
    If Inductor's wrapper changes shape, this returns None (the CPU graph then runs the
    generated ``call`` on every replay: as fast as before, never wrong)."""
    fn = getattr(compiled, "current_callable", None)
    keep = getattr(fn, "graphgear_keep", None)
    g = inductor_wrapper_globals(compiled)
    runner = None if g is None else g.get("Runner")
    call = getattr(runner, "call", None)
    # the generated call itself, or graphgear's argument dropping around it: any other
    # wrapper Inductor put around it (copying misaligned inputs) must keep running
    inner = getattr(fn, "__wrapped__", None) if keep is not None else fn
    if call is None or g is None or inner is not g.get("call"):
        return None
    try:
        source = textwrap.dedent(inspect.getsource(call))
    except (OSError, TypeError) as e:
        log.debug("graphgear: Inductor's wrapper is not straight-line code (%s: %s)", type(e).__name__, e)
        return None
    return GeneratedCall(keep=None if keep is None else tuple(keep), source=source,
                         names=types.MappingProxyType(g))

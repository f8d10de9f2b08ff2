"""Dynamo (``torch._dynamo``, ``torch._C._dynamo``): dim markings, the
``isolate_recompiles`` region and cache entries of a compiled function, the code a
served model runs, the frame callback and compiler stance, ``nn.Module``'s hook dicts,
dynamo's error type for a backend, the ``GraphArg`` of a placeholder, dynamo's
compile lock, and which top-level compiled call a thread is in (``compiled_call_token``).

Checked on 2.13 (CPU build) and 2.14.1 (``isolate_recompiles`` is new in 2.13). If these
moved, a served model would run every call through dynamo's frame evaluation (correct,
slower: ``graphgear.served``), ``set_dim_gears`` could not make a geared dim symbolic,
inputs would be named by position, and a run-time compile could race dynamo's; each
wrapper has its note.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

# torch._dynamo.eval_frame (its cache-entry listing, stance and frame-callback query) and
# torch.nn.modules.module (the global hook dicts): read by graphgear.served on every
# served call, so bound once here; graphgear's import already imports torch._dynamo.
# Checked on 2.13 and 2.14.1; each wrapper below (dynamo_entries, dynamo_frame_active,
# module_call_hooks) has its note.
from torch._dynamo import eval_frame as _dynamo_eval_frame
from torch._dynamo import mutation_guard as _mutation_guard
from torch.nn.modules import module as _nn_module

_cache_entries_for_region = getattr(_dynamo_eval_frame, "_get_cache_entries_for_region", None)
_eval_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback

__all__ = [
    "backend_compiler_failed",
    "compile_session",
    "compiled_call_token",
    "copy_dynamo_graph",
    "compiled_call_generation",
    "dynamo_code_function",
    "dynamo_entries",
    "dynamo_frame_active",
    "dynamo_graph_arg",
    "dynamo_region",
    "dynamo_served_codegen",
    "has_dynamo_graph_arg",
    "mark_dynamic",
    "module_call_hooks",
    "without_dim_markings",
]


def copy_dynamo_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of dynamo's graph ``gm`` (its own graph, the same nodes' metadata) that
    AOTAutograd still takes for dynamo's: ``gm.meta`` (``dynamo_compile_id``),
    ``_param_name_to_source`` and each placeholder's ``_dynamo_source``.

    Checked on 2.13 (``_functorch/_aot_autograd/frontend_utils.py``: AOTAutograd finds
    the static inputs, the parameters a captured graph need not copy, from these three;
    "When gm is modified ..., metadata needs to be propagated in order to be recognized
    as a dynamo graph"). If they moved, a copy would be taken for a graph of unknown
    origin: correct, but every parameter copied into static buffers at capture."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copied = torch.fx.GraphModule(gm, graph)
    copied.meta.update(getattr(gm, "meta", {}))
    if hasattr(gm, "_param_name_to_source"):
        copied._param_name_to_source = gm._param_name_to_source
    for old, new in zip(gm.graph.find_nodes(op="placeholder"), graph.find_nodes(op="placeholder"), strict=True):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source  # type: ignore[attr-defined]
    return copied


def mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Tell dynamo that dim ``dim`` of ``t`` is dynamic.

    ``torch._dynamo.mark_dynamic``: checked on 2.13; documented in torch's dynamic-shapes
    guide (2.11 to 2.14), but under ``torch._dynamo``. If it moved, ``set_dim_gears`` could
    not make a geared dim symbolic: dynamo would compile one graph per size."""
    import torch._dynamo

    torch._dynamo.mark_dynamic(t, dim)


def without_dim_markings(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or, when ``mark_dynamic`` (``set_dim_gears``) marked it, an alias
    without the markings (``detach``: a new tensor object over the same memory).

    torch 2.13's serialised guards (``aot_compile`` / ``load_compiled_function``) load a
    guard that says the input had no dim marking at compile time, so a marked tensor
    fails it ("_has_dynamo_dim_marking is present on runtime tensor but was absent at
    compile time"), while an unmarked one passes both a freshly compiled and a loaded
    entry's guards (checked on 2.13). The markings only steer dynamo's trace; a compiled
    entry's dims are already symbolic and graphgear checks the gears itself. Tensors that
    require grad are left as they are (their guard then decides)."""
    if getattr(t, "_has_dynamo_dim_marking", False) and not t.requires_grad:
        return t.detach()
    return t


def dynamo_region(compiled: Any) -> int | None:
    """The ``isolate_recompiles`` region of a ``torch.compile`` result (an
    ``OptimizedModule`` or a compiled function), None when it has none.

    ``OptimizedModule.dynamo_ctx._isolate_recompiles_id`` / a compiled function's
    ``_isolate_recompiles_id``: checked on 2.13 (``isolate_recompiles`` is new in 2.13).
    If it went, a served model would run every call through dynamo's frame evaluation
    (correct, slower: see ``graphgear.served``)."""
    ctx = getattr(compiled, "dynamo_ctx", None)
    rid = getattr(ctx if ctx is not None else compiled, "_isolate_recompiles_id", None)
    return rid if isinstance(rid, int) and rid >= 0 else None


def dynamo_entries(code: types.CodeType, region: int) -> list[tuple[Any, types.CodeType]]:
    """``(guard manager, compiled code)`` of each of dynamo's cache entries for ``code``
    in one ``isolate_recompiles`` region, most recently used first; [] when there are
    none or this torch cannot list them.

    ``torch._dynamo.eval_frame._get_cache_entries_for_region`` and
    ``CacheEntry.guard_manager`` / ``.code``: checked on 2.13; the guard manager's
    ``check(f_locals)`` is what dynamo's frame evaluation runs (``guards.py``, 2.13). If
    they moved, a served model would run every call through dynamo's frame evaluation."""
    if _cache_entries_for_region is None:
        return []
    return [(e.guard_manager, e.code) for e in _cache_entries_for_region(code, region)]


def dynamo_code_function(code: types.CodeType, fn: types.FunctionType) -> types.FunctionType | None:
    """dynamo's compiled code for a frame of ``fn`` as a plain function (``fn``'s
    globals, defaults and closure), None for code with a graph break.

    The compiled code reads its graphs (``__compiled_fn_*``) from the frame's globals,
    where dynamo installs them, and keeps the frame's signature, so it runs as ``fn``
    would (vLLM's dispatcher runs it the same way). A graph break's resume functions
    (``__resume_at_*``) are compiled by dynamo's frame evaluation when called, so code
    calling one must go through dynamo. Checked on 2.13 (``bytecode_transformation``,
    ``resume_execution``)."""
    if any(name.startswith("__resume_at_") for name in code.co_names):
        return None
    run = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    run.__kwdefaults__ = fn.__kwdefaults__
    return run


def dynamo_served_codegen(*, frozen: bool) -> Any:
    """A context manager for the calls through dynamo of a served model (where dynamo
    compiles its code), setting two ``torch._dynamo.config`` options that dynamo reads
    when it generates a frame's code:

    - ``record_runtime_overhead=False``: the compiled code does not call
      ``record_pregraph_bytecode_enter`` / ``_exit`` around fetching the graph's inputs
      (two ``torch._dynamo.disable``-wrapped calls on every call, there only to put a
      "Pregraph bytecode" range into profiler traces): the served tiny Qwen2 step 2-3 %
      faster (2026-12-03, same process, 147.7 vs 150.7 and 150.6 vs 155.3 µs).
    - ``frozen``: ``install_free_tensors=True``: a module's parameters are compiled into
      the graph instead of passed as inputs the compiled code fetches on every call; only
      for final parameters (``frozen_parameter``): the served step is 6-7 % faster (28
      fewer inputs on a 2-layer Qwen2).

    Checked on 2.13 (``install_free_tensors`` a ``torch._dynamo.config`` option since
    2.6; ``record_runtime_overhead`` read by ``torch/_dynamo/codegen.py`` and AOT's
    runtime wrapper). An option this torch does not have is left out (the code then
    keeps dynamo's default); ``patch`` raises if dynamo's config changes shape."""
    from torch._dynamo import config as dynamo_config

    options: dict[str, Any] = {}
    if hasattr(dynamo_config, "record_runtime_overhead"):
        options["record_runtime_overhead"] = False
    if frozen:
        options["install_free_tensors"] = True
    return dynamo_config.patch(**options) if options else contextlib.nullcontext()


def dynamo_frame_active() -> bool:
    """Whether a call now would not be a plain top-level call of compiled code: dynamo's
    frame callback is set (inside another compiled call or a trace) or the compiler
    stance is not ``default`` (``torch.compiler.set_stance``).

    ``torch._C._dynamo.eval_frame.get_eval_frame_callback`` and
    ``torch._dynamo.eval_frame._stance``: checked on 2.13 (``set_stance`` reads both)."""
    # is_compiling first: under a trace dynamo folds it to True and never reaches the
    # callback query, which it cannot trace
    return (torch.compiler.is_compiling() or _eval_frame_callback() is not None
            or _dynamo_eval_frame._stance.stance != "default")


def module_call_hooks(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` would run hooks (its own or global ones) around its
    ``forward``: the test ``nn.Module._call_impl`` makes before its fast path.

    ``Module._forward_hooks`` / ``_forward_pre_hooks`` / ``_backward_hooks`` /
    ``_backward_pre_hooks`` and ``torch.nn.modules.module._global_*_hooks``: checked on
    2.13 (``_call_impl``, 2.11 to 2.14)."""
    m = _nn_module
    return bool(module._backward_hooks or module._backward_pre_hooks or module._forward_hooks
                or module._forward_pre_hooks or m._global_backward_pre_hooks or m._global_backward_hooks
                or m._global_forward_hooks or m._global_forward_pre_hooks)


def backend_compiler_failed(backend: Any, exc: BaseException, frame: Any) -> Exception:
    """Dynamo's ``BackendCompilerFailed`` for ``exc`` raised by ``backend``, to raise.

    ``torch._dynamo.exc.BackendCompilerFailed(backend_fn, inner_exception, frame)``:
    checked on 2.13 (dynamo's own ``OutputGraph`` builds it the same way in 2.13). If its
    signature changed, a graphgear error raised under ``torch.compile`` would lose its
    ``__cause__`` (dynamo would wrap it itself)."""
    from torch._dynamo.exc import BackendCompilerFailed

    return BackendCompilerFailed(backend, exc, frame)


def dynamo_graph_arg(node: torch.fx.Node) -> Any:
    """Dynamo's ``GraphArg`` of a placeholder (its ``.source`` names the user's input),
    None for a graph dynamo did not make.

    ``node.meta["grapharg"]``: checked on 2.13; set by dynamo's ``output_graph`` and
    ``variables.builder`` in 2.13. If it went, inputs would be named by position and graphgear could not tell a
    dynamo graph from a direct call."""
    return node.meta.get("grapharg")


def has_dynamo_graph_arg(node: torch.fx.Node) -> bool:
    """Whether dynamo gave this placeholder a ``GraphArg`` (see :func:`dynamo_graph_arg`)."""
    return "grapharg" in node.meta


@contextlib.contextmanager
def compile_session() -> Any:
    """What dynamo holds around its own compiles, held around a compile graphgear makes
    at run time (a gear built on its first call, a capture's native code): dynamo's
    compile lock and the process-wide "a compile is running" flag.

    Why: an FX trace (``make_fx``, and Inductor's pattern matcher, which traces
    replacements) patches ``torch.nn.Module.__call__`` process-wide and sets FX's global
    tracing flag; a compiled module called meanwhile from another thread is refused by
    dynamo ("Detected that you are using FX to symbolically trace a dynamo-optimized
    function") unless the compile flag is set, and two traces at once corrupt each
    other's patches (FX asserts ``CURRENT_PATCHER is None``). Under the lock a run-time
    compile waits for dynamo's compiles and theirs for it; under the flag another
    thread's call passes dynamo's check and waits at the lock or the engine's own.

    ``torch._dynamo.convert_frame.compile_lock`` (an ``RLock``; 2.11 to 2.14) and
    ``torch.compiler._compile_session_context`` (dynamo's ``compile_inner`` enters it;
    checked on 2.13 and 2.14.1): if the latter is missing only the lock is held, and a compiled
    module called from another thread during the compile may be refused as before."""
    from torch._dynamo.convert_frame import compile_lock

    session = getattr(torch.compiler, "_compile_session_context", None)
    with compile_lock, (session() if session is not None else contextlib.nullcontext()):
        yield


def _compile_wrapper_code() -> types.CodeType | None:
    """The code of the function every call of a ``torch.compile``'d callable runs first
    (``_TorchDynamoContext.__call__``'s nested ``compile_wrapper``), or None."""
    outer = vars(getattr(_dynamo_eval_frame, "_TorchDynamoContext", object)).get("__call__")
    for c in getattr(getattr(outer, "__code__", None), "co_consts", ()):
        if isinstance(c, types.CodeType) and c.co_name == "compile_wrapper":
            return c
    return None


_COMPILE_WRAPPER = _compile_wrapper_code()
#: a local of ``compile_wrapper`` made afresh by each call and held until it returns
_CALL_LOCAL = "saved_include_set"


def compiled_call_generation() -> int:
    """Dynamo's count of calls of ``torch.compile``'d callables (all threads): it moves
    whenever any top-level compiled call starts (cudagraph trees read it the same way).

    ``torch._dynamo.mutation_guard.GenerationTracker.generation`` (each top-level call's
    ``install_generation_tagging_init`` adds one; checked on 2.13). Missing: -1, and
    :func:`compiled_call_token` is then asked on every hand-out (correct, slower)."""
    tracker = getattr(_mutation_guard, "GenerationTracker", None)
    return int(getattr(tracker, "generation", -1))


def compiled_call_token(frame: types.FrameType | None) -> Any | None:
    """An object that lives exactly as long as the outermost call of a
    ``torch.compile``'d callable now running on this thread's stack (from ``frame``
    outwards), or None outside any. Two hand-outs belong to the same top-level call
    when their tokens are the same object; the token dies when that call returns.

    The outermost frame of dynamo's ``compile_wrapper`` (the function every compiled
    callable's call enters: ``torch._dynamo.eval_frame._TorchDynamoContext.__call__``)
    and its local ``saved_include_set`` (a fresh ``DispatchKeySet`` per call, weakly
    referenceable); checked on 2.13. If either moved this gives None: every graph call
    is then a top-level call of its own, as before graphgear knew about steps (a graph
    called twice in one forward raises its stale-output error instead of running in a
    second capture)."""
    code = _COMPILE_WRAPPER
    if code is None:
        return None
    outermost = None
    while frame is not None:
        if frame.f_code is code:
            outermost = frame
        frame = frame.f_back
    if outermost is None:
        return None
    return outermost.f_locals.get(_CALL_LOCAL)

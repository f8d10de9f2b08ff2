"""Every private torch API graphgear relies on, in one place, with its version notes.

Private means: ``torch._C._*``, ``torch._inductor``, ``torch._functorch``,
``torch._subclasses``, ``torch._guards``, ``torch._decomp``, ``torch._ops``,
``torch._dynamo``, ``torch.fx.experimental._config``, ``torch.utils._pytree``,
``torch.utils._triton``, private storage methods and the globals of Inductor's generated
code. Other modules import the wrappers and re-exports here instead of reaching into
those themselves (``tests/test_layout.py::test_private_torch_apis_only_in_torch_module``
enforces it), so a torch upgrade that moves something breaks here, visibly, and nowhere
else. This module imports no graphgear module (bottom layer).

Public, and so used directly elsewhere: ``torch.compiler.reset`` (documented; in 2.13
it is ``import torch._dynamo; torch._dynamo.reset()``), ``torch.compiler.config``,
``torch.fx`` and ``torch.fx.experimental.proxy_tensor.make_fx`` /
``torch.fx.experimental.symbolic_shapes`` (not underscored). ``torch._dynamo.mark_dynamic``
is documented (dynamic-shapes guide) but lives in ``torch._dynamo``, so it is wrapped
here too; no private name is allowed outside this module.

Private attributes of public objects are wrapped here too: an ``OpOverload``'s
``_schema`` / ``_opname`` / ``_overloadname`` / ``_qualified_op_name`` (:func:`op_schema`
and friends), ``fx.Node._erased`` (:func:`node_erased`), AOTAutograd's ``_boxed_call``
protocol (:func:`boxed_convention`, :func:`is_boxed`) and ``make_fx``'s
``_allow_non_fake_inputs`` keyword. ATen's underscored ops (``aten._fused_rms_norm``)
are public op names and used where needed.

Version notes: "checked on 2.13" means the name was imported and exercised by the test
suite on torch 2.13.0 (CPU build). The project claims 2.13 and 2.14 (pyproject), the
versions its core suite ran on; "2.11 to 2.14" in a note says the name is in those
releases' sources. Where an item could not be checked on other versions the note names
the torch code that uses the same API in 2.13, which is what keeps it stable in practice.

Tested on torch 2.13.0 (CPU build, CI) and 2.14.1 (CUDA build, core suite on the CPU,
``scripts/torch_matrix.sh``); the CUDA tests ran once on 2.11.0 (CUDA 13, a lent H200).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import sys
import tempfile
import textwrap
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

# torch._dynamo.eval_frame (its cache-entry listing, stance and frame-callback query) and,
# further down, torch.nn.modules.module (the global hook dicts): read by graphgear.served
# on every served call, so bound once here; graphgear's import already imports
# torch._dynamo. Checked on 2.13 and 2.14.1; each wrapper below (dynamo_entries,
# dynamo_frame_active, module_call_hooks) has its note.
from torch._dynamo import eval_frame as _dynamo_eval_frame

# Re-exports. ``import torch`` already imports all four modules (checked on 2.13), so
# importing them here costs nothing.
#
# torch._guards.TracingContext / tracing / detect_fake_mode: checked on 2.13; dynamo and
# AOTAutograd install the context with them (2.11 to 2.14). If they moved, graphgear would
# lose AOTAutograd's static-input indices, the tracing context its Inductor compiles need
# for the FX graph cache, and the fake mode of a graph.
from torch._guards import TracingContext, detect_fake_mode, tracing

# torch._inductor.output_code.OutputCode: checked on 2.13 (the base of Inductor's
# CompiledFxGraph and of dynamo's AOTEagerOutputCode, 2.11 to 2.14); importing it costs
# ~20 ms. AOTAutograd's bundled cache entry holds a compiler's result only when it is
# one (``AOTAutogradCache.make_entry``); graphgear's bundled result subclasses it.
from torch._inductor.output_code import OutputCode

# torch._ops.OpOverload / OpOverloadPacket: checked on 2.13; every FX graph traced by
# make_fx/AOTAutograd has them as call targets (2.11 to 2.14). If they moved, graphgear
# could not tell aten calls from other callables (op summaries, mutated-input detection,
# in-place recovery, the aten-graph check).
from torch._ops import OpOverload, OpOverloadPacket

# torch._subclasses.fake_tensor.FakeTensor / FakeTensorMode / unset_fake_temporarily:
# checked on 2.13; dynamo, AOTAutograd and Inductor all use them (2.11 to 2.14). If they
# moved, graphgear could not re-trace graphs (gears, static graphs, decompositions) or
# tell fake example inputs from real ones.
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

# torch.nn.modules.module: for module_call_hooks (see the torch._dynamo note above)
from torch.nn.modules import module as _nn_module

# torch.utils._pytree: checked on 2.13; torch's own tree utilities (used throughout
# dynamo/AOTAutograd, 2.11 to 2.14). If it moved, graphgear could not flatten a graph's
# outputs for Inductor or the arguments of an op it inlines. ``pytree.tree_flatten`` /
# ``tree_unflatten`` are all graphgear uses.
from torch.utils import _pytree as pytree

log = logging.getLogger(__name__)

_cache_entries_for_region = getattr(_dynamo_eval_frame, "_get_cache_entries_for_region", None)
_eval_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback

__all__ = [
    "adopt_vec_isa",
    "inductor_vec_isa_if_known",
    "serializable_guard_filter",
    "changed_traced_sources",
    "compile_session",
    "inductor_config_digest",
    "inductor_output_load",
    "inductor_output_for_disk",
    "aot_compiled_backend_result",
    "load_bundled_entry",
    "bundled_entry_outputs",
    "serializable_compiler",
    "aot_bundling",
    "OutputCode",
    "SerializableCallable",
    "autograd_cache_off",
    "graph_pickle_dumps",
    "graph_pickle_loads",
    "tracing_with",
    "INDUCTOR_ALLOC_NAMES",
    "INDUCTOR_CPP_WRAPPER_NAMES",
    "FakeTensor",
    "FakeTensorMode",
    "OpOverload",
    "OpOverloadPacket",
    "StorageWeakRef",
    "TracingContext",
    "aot_input_source",
    "functional_all_reduce",
    "aot_module_simplified",
    "aot_partition_fn",
    "backend_compiler_failed",
    "aot_forward_returns",
    "aot_tangents",
    "count_tangents",
    "decomp_fused_rms_norm",
    "decomp_fused_rms_norm_backward",
    "dynamo_code_function",
    "dynamo_entries",
    "dynamo_frame_active",
    "dynamo_graph_arg",
    "dynamo_region",
    "dynamo_served_codegen",
    "enable_python_dispatcher",
    "fake_mode_of",
    "get_backed_size_oblivious",
    "has_dynamo_graph_arg",
    "has_internal_overlap",
    "has_kernel_for_dispatch_key",
    "has_storage",
    "has_triton",
    "inductor_callable",
    "inductor_drop_args",
    "inductor_compile_fx_inner",
    "inductor_donated_buffers",
    "inductor_config_patch",
    "inductor_decomp_table",
    "inductor_lowering",
    "inductor_mark_frozen",
    "inductor_one_row_decompose_limit",
    "inductor_load_cpp_kernel",
    "register_inductor_extern_out",
    "inductor_remove_noop_ops",
    "inductor_replace_random",
    "inductor_virtual_fake_mode",
    "inductor_wrapper_globals",
    "inductor_is_cpp_wrapper",
    "inductor_straight_line",
    "StraightLine",
    "boxed_convention",
    "is_boxed",
    "make_boxed_func",
    "mark_dynamic",
    "module_call_hooks",
    "non_owning_storage",
    "pattern_matcher_pass",
    "pytree",
    "register_pattern",
    "set_backed_size_oblivious",
    "make_fx_allowing_real_inputs",
    "node_erased",
    "op_name",
    "op_overload_name",
    "op_packet_name",
    "op_schema",
    "stable_topological_sort",
    "without_dim_markings",
    "storage_id",
    "storage_poisoner_builtin",
    "storage_use_count",
    "tensor_use_count",
    "tensor_version",
    "tracing",
    "unset_fake_temporarily",
]


def non_owning_storage(ptr: int, device: torch.device, nbytes: int) -> torch.UntypedStorage:
    """A storage over ``nbytes`` at ``ptr`` that does not own (and never frees) the memory.

    ``torch._C._construct_storage_from_data_pointer``: present in 2.11 to 2.14 on every
    build (cudagraph trees use it for the same purpose)."""
    return torch._C._construct_storage_from_data_pointer(ptr, device, nbytes)


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements may share memory (expanded or overlapping strides).

    ``torch._debug_has_internal_overlap`` returns 0 (no), 1 (yes) or 2 (too hard to
    tell); 2 is treated as yes. Present in 2.11 to 2.14."""
    return torch._debug_has_internal_overlap(t) != 0


class StorageWeakRef:
    """A weak reference to a storage (its ``StorageImpl``), not to a tensor: it stays
    alive while any tensor or view over that storage does, whether or not autograd
    tracks the view (views made under ``torch.inference_mode()`` keep no ``_base``).

    Built on ``UntypedStorage._weak_ref`` / ``_expired`` / ``_new_with_weak_ptr`` /
    ``_free_weak_ref`` (present in 2.11 to 2.14; ``torch.multiprocessing.reductions``
    and cudagraph trees use them). ``cdata`` is the ``StorageImpl`` address.
    """

    __slots__ = ("cdata",)
    # bound here: at interpreter exit ``torch`` may already be None in this module
    # when the last references are collected
    _free = staticmethod(torch.UntypedStorage._free_weak_ref)

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.cdata: int = storage._weak_ref()

    def expired(self) -> bool:
        return torch.UntypedStorage._expired(self.cdata)

    def __call__(self) -> torch.UntypedStorage | None:
        """A strong reference to the storage, or None when it is gone."""
        return torch.UntypedStorage._new_with_weak_ptr(self.cdata)

    def __del__(self) -> None:
        cdata = getattr(self, "cdata", None)
        if cdata is not None:
            self._free(cdata)


def storage_use_count(cdata: int) -> int:
    """How many strong references the ``StorageImpl`` at ``cdata`` (a
    :class:`StorageWeakRef`'s) has: one per tensor or view over it, one per live Python
    storage object, one per NumPy array taken with ``Tensor.numpy()``.

    ``torch._C._storage_Use_Count``: present in 2.11 to 2.14 (cudagraph trees tell dead
    outputs from live ones with it). If it went, graphgear could not hand an unreferenced
    output out again and would make a new alias each replay (``capture/liveness``)."""
    return torch._C._storage_Use_Count(cdata)


#: ``t._version``, the version counter every in-place write of ``t``'s data advances,
#: as a plain function (a getset descriptor's getter: ``map`` calls it without a Python
#: frame). ``Tensor._version``: checked on 2.13 (autograd's own check of saved tensors
#: reads it, 2.0 to 2.14). If it went, frozen code would not see weights written in place.
tensor_version = torch.Tensor._version.__get__


def tensor_use_count(t: torch.Tensor) -> int:
    """How many strong references ``t``'s ``TensorImpl`` has from C++: 1 when only its
    Python object holds it; more when a view's ``_base``, an autograd node's saved
    tensor or another C++ owner does.

    ``Tensor._use_count``: present in 2.11 to 2.14 (cudagraph trees and
    ``torch.utils.swap_tensors`` use it)."""
    return t._use_count()


def storage_poisoner_builtin() -> Callable[[int, str], None] | None:
    """torch's own storage-level poison, where the build has it.

    ``torch._C._set_storage_data_ptr_access_error_msg(storage_impl_address, msg)`` makes
    every later data access through that ``StorageImpl`` (so through every tensor and
    view over it) raise ``RuntimeError(msg)``; it releases the storage's data pointer
    (for a non-owning storage that frees nothing). CUDA builds of 2.11 to 2.14 have it
    (it is defined next to the CUDA graph bindings); CPU builds do not, and graphgear
    builds a three-line extension with the same effect instead (``capture/liveness``).
    Not to be confused with ``_set_storage_access_error_msg(tensor, msg)``, which
    poisons one tensor and leaves its views readable."""
    return getattr(torch._C, "_set_storage_data_ptr_access_error_msg", None)


def stable_topological_sort(graph: torch.fx.Graph) -> None:
    """Reorder ``graph`` so every node follows its inputs, keeping the order otherwise.

    ``torch._inductor.pattern_matcher.stable_topological_sort``: present in 2.11 to 2.14.
    Without it graphgear's pattern replacements could leave a node before an input."""
    from torch._inductor.pattern_matcher import stable_topological_sort as sort

    sort(graph)


def fake_mode_of(values: Any) -> Any:
    """The fake mode of the first fake tensor among ``values`` (or of the active tracing
    context), None when there is none.

    ``torch._guards.detect_fake_mode``: present in 2.11 to 2.14."""
    return detect_fake_mode(list(values))


# --------------------------------------------------------------------------- tensors, ops


def has_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` has a storage (fake tensors do; some subclasses and sparse tensors
    do not).

    ``torch._C._has_storage``: checked on 2.13; used by torch's own
    ``torch._subclasses.fake_utils`` and ``torch._inductor.fx_utils`` in 2.13. If it went, the no-op
    removal pass could not tell which nodes share memory."""
    return torch._C._has_storage(t)


def storage_id(storage: torch.UntypedStorage) -> int:
    """The address of a storage's ``StorageImpl``: equal for every tensor and view over
    it, and what the poison functions take.

    ``UntypedStorage._cdata``: checked on 2.13; torch's own ``torch._library.utils``
    groups tensors by storage the same way in 2.13. If it went, the
    no-op removal pass could not group nodes by memory and stale outputs could not be
    poisoned."""
    return storage._cdata


def has_kernel_for_dispatch_key(op_name: str, key: str) -> bool:
    """Whether the operator ``op_name`` (``"aten::_fused_rms_norm"``) has a kernel of its
    own registered for dispatch key ``key`` (``"CPU"``, ``"CUDA"``).

    ``torch._C._dispatch_has_kernel_for_dispatch_key``: checked on 2.13; used by torch's
    own ``torch._meta_registrations`` and ``torch._library`` in 2.13. If it went, the RMSNorm
    fusion could not tell where the fused op is worth it."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op_name, key)


def decomp_fused_rms_norm(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
                          eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten._fused_rms_norm`` written with aten ops.

    ``torch._decomp.decompositions._fused_rms_norm``: checked on 2.13 (torch registers it
    as the op's decomposition). If it went, Inductor would call the fused RMSNorm as an
    extern kernel instead of fusing it with its neighbours."""
    from torch._decomp.decompositions import _fused_rms_norm

    return _fused_rms_norm(x, normalized_shape, weight, eps)


def decomp_fused_rms_norm_backward() -> Callable[..., Any]:
    """``aten._fused_rms_norm_backward`` written with aten ops (the function itself).

    ``torch._decomp.decompositions._fused_rms_norm_backward``: checked on 2.13 (torch
    registers it as the op's decomposition). If it went, as :func:`decomp_fused_rms_norm`,
    for the backward."""
    from torch._decomp.decompositions import _fused_rms_norm_backward

    return _fused_rms_norm_backward


# --------------------------------------------------------------------------- dynamo


def mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Tell dynamo that dim ``dim`` of ``t`` is dynamic.

    ``torch._dynamo.mark_dynamic``: checked on 2.13; documented in torch's dynamic-shapes
    guide (2.11 to 2.14), but under ``torch._dynamo``. If it moved, ``set_dim_gears`` could
    not make a geared dim symbolic: dynamo would compile one graph per size."""
    import torch._dynamo

    torch._dynamo.mark_dynamic(t, dim)


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


# --------------------------------------------------------------------------- distributed


def functional_all_reduce(t: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """``torch.distributed._functional_collectives.all_reduce(t, op, group)``: the
    traceable all-reduce (a new tensor; dynamo and AOTAutograd keep it in the graph as
    ``_c10d_functional.all_reduce`` + ``wait_tensor``).

    Checked on 2.13; DTensor's own redistribution and dynamo's remap of
    ``dist.all_reduce`` (``traceable_collective_remaps``) use the same module in 2.13
    (2.11 to 2.14). Imported here, on first use, so ``import graphgear`` does not load
    torch.distributed's modules. If it moved, the hand-written tensor-parallel decoder
    (``graphgear.toy_decoder_tp``) could not reduce its row-parallel outputs."""
    import torch.distributed._functional_collectives as fc

    return fc.all_reduce(t, op, group)


# --------------------------------------------------------------------------- AOTAutograd


def aot_module_simplified(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """``torch._functorch.aot_autograd.aot_module_simplified``, leaving out the keyword
    arguments this torch's version does not take (logged at debug level).

    Checked on 2.13; it is what ``torch._dynamo.backends.common.aot_autograd`` calls in
    2.13 (2.11 to 2.14). If it moved, no graphgear backend could compile.

    Like that helper, it counts the call in ``torch._dynamo.utils.counters["aot_autograd"]
    ["total"]`` (2.11 to 2.14): dynamo's DDP optimizer (``_dynamo/backends/distributed.py``)
    compiles each bucket's submodule with the backend under ``fakify_first_call``, where
    AOTAutograd's compiled function returns fake outputs on its first call, and it makes
    that first call itself only when the count moved. Without it the DDP optimizer skips
    that call and the user's first real step receives the fake tensors."""
    from torch._dynamo.utils import counters
    from torch._functorch.aot_autograd import aot_module_simplified as aot

    counters["aot_autograd"]["total"] += 1

    params = inspect.signature(aot).parameters
    dropped = [k for k in kwargs if k not in params]
    for k in dropped:
        log.debug("graphgear: this torch's aot_module_simplified has no %r; leaving it out", k)
        kwargs.pop(k)
    return aot(gm, example_inputs, **kwargs)


def aot_input_source(node: torch.fx.Node) -> tuple[int, tuple[str, ...]] | None:
    """Which input of the callable given to AOTAutograd an AOT graph's placeholder holds:
    ``(i, ())`` for input ``i`` itself, ``(i, ("_local_tensor",))`` for an inner tensor
    of input ``i`` when that input is a tensor subclass (a DTensor parameter) that
    AOTAutograd flattened (also a size or stride of one: ``("size", "0")``); None for what
    AOTAutograd added itself (parameters it lifted, effect tokens, RNG seeds, synthetic
    bases) or a placeholder with no descriptor.

    ``node.meta["desc"]`` with ``torch._functorch._aot_autograd.descriptors``'
    ``PlainAOTInput(idx)`` / ``SubclassGetAttrAOTInput(base, attr)`` /
    ``SubclassSizeAOTInput`` / ``SubclassStrideAOTInput``: checked on 2.13 (AOTAutograd's
    ``graph_capture`` sets it on every placeholder of the forward, inference and joint
    graphs; the partitioner keeps it). If it went (older or newer torch), this returns
    None and graphgear places gears and names counting from the end, which is right
    unless an input is a flattened subclass."""
    try:
        from torch._functorch._aot_autograd import descriptors as d
    except ImportError:
        return None
    desc = node.meta.get("desc")
    path: list[str] = []
    while True:
        if isinstance(desc, d.SubclassGetAttrAOTInput):
            path.append(desc.attr)
        elif isinstance(desc, d.SubclassSizeAOTInput):
            path += [str(desc.idx), "size"]
        elif isinstance(desc, d.SubclassStrideAOTInput):
            path += [str(desc.idx), "stride"]
        else:
            break
        desc = desc.base
    if isinstance(desc, d.PlainAOTInput):
        return desc.idx, tuple(reversed(path))
    return None


def aot_partition_fn(min_cut: bool) -> Callable[..., Any]:
    """AOTAutograd's joint-graph partitioner: ``min_cut_rematerialization_partition`` (as
    Inductor uses) or ``default_partition``.

    ``torch._functorch.partitioners``: checked on 2.13; dynamo's ``aot_autograd`` backend
    helper and Inductor's ``compile_fx`` use ``min_cut_rematerialization_partition`` in
    2.13 (2.11 to 2.14). If they moved, training graphs could not be split into
    forward and backward."""
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    return min_cut_rematerialization_partition if min_cut else default_partition


#: AOTAutograd's boxed calling protocol: a compiled callable whose ``_boxed_call`` is
#: True is called with one list of arguments (which it may clear), any other with
#: ``*args``. Checked on 2.13 (``_aot_autograd/runtime_wrappers.py`` reads it with
#: ``getattr(fn, "_boxed_call", False)``; 2.11 to 2.14 do the same). If it were renamed,
#: AOTAutograd would call graphgear's boxed graphs with ``*args`` and they would fail at
#: their first call, loudly.
_BOXED_ATTR = "_boxed_call"

_T = TypeVar("_T")


def boxed_convention(obj: _T) -> _T:
    """Declare ``obj`` (a function, or a class whose instances are called) boxed: it takes
    one list of arguments. Returns ``obj``, so it serves as a decorator."""
    setattr(obj, _BOXED_ATTR, True)
    return obj


def is_boxed(fn: Any) -> bool:
    """Whether ``fn`` follows the boxed convention (see :func:`boxed_convention`)."""
    return bool(getattr(fn, _BOXED_ATTR, False))


def make_boxed_func(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` taking one list of arguments (AOTAutograd's boxed calling convention).

    ``torch._functorch.aot_autograd.make_boxed_func``: checked on 2.13; AOTAutograd's own
    runtime wrappers use it in 2.13 (2.11 to 2.14). If it moved, graphgear could not
    hand an unboxed callable to AOTAutograd."""
    from torch._functorch.aot_autograd import make_boxed_func as boxed

    return boxed(fn)


# --------------------------------------------------------------------------- Inductor
# Every function here imports torch._inductor lazily: it is heavy, and run_eagerly never
# needs it.


def inductor_decomp_table() -> dict[Any, Any]:
    """Inductor's decomposition table (it leaves out the entries that break attention
    gradients on the CPU); Inductor's own object, not a copy.

    ``torch._inductor.decomposition.select_decomp_table``: checked on 2.13; Inductor's
    ``compile_fx`` uses it (2.11 to 2.14). If it moved, max-autotune, the pattern tracer
    and the static graphs the CPU graph compiles would lose their decompositions."""
    from torch._decomp import core_aten_decompositions  # noqa: F401  (registers tables)
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


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


def inductor_replace_random(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Inductor's random-op rewrite (``aten.rand``/``randn``/``bernoulli``/dropout to its
    own seeded ops), which its lowering requires and ``compile_fx`` runs among its joint
    graph passes before ``compile_fx_inner`` (that graphgear calls directly); returns the
    number of rewrites. Without it, a graph with dropout in training mode fails in
    Inductor's lowering ("should have been handled in replace_random.py").

    ``torch._inductor.fx_passes.replace_random.replace_random_passes``: checked on 2.13
    (2.11 to 2.14); a no-op under ``torch._inductor.config.fallback_random``. If it
    moved, such graphs fail to compile as before (max-autotune raises Inductor's error,
    a capture falls back to the uncompiled graph). Its rewrites trace replacements in
    Inductor's virtualized fake mode (``V.set_fake_mode``): the example inputs'."""
    from torch._inductor.fx_passes.replace_random import replace_random_passes
    from torch._inductor.virtualized import V

    if not any(n.op == "call_function" and n.target in _RANDOM_OPS() for n in gm.graph.nodes):
        return 0
    fake_mode = detect_fake_mode(list(example_inputs)) or FakeTensorMode(allow_non_fake_inputs=True)
    with V.set_fake_mode(fake_mode):
        count = int(replace_random_passes(gm) or 0)
    if count:
        gm.recompile()
    return count


@functools.cache
def _RANDOM_OPS() -> frozenset[Any]:  # noqa: N802 - a constant, built on first use
    """The ops ``replace_random``'s patterns match (2.13); dropout and ``bernoulli``
    reach Inductor decomposed into ``rand``."""
    aten = torch.ops.aten
    return frozenset({aten.rand.default, aten.rand.generator, aten.randn.default, aten.randn.generator,
                      aten.randint.low})


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


def inductor_realize(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself (a contiguous tensor), marked so Inductor stores it in a buffer rather
    than recomputing it inside each consumer's loop.

    Inductor inlines a pointwise value into every kernel that reads it; a reduction that
    reads it broadcast (a decode query against every key) recomputes it once per broadcast
    element, sines and cosines of a rotary embedding included. Inductor's
    ``prims.inductor_force_stride_order`` (what its own post-grad passes use to pin
    layouts) lowers to ``ExternKernel.require_stride_order``, which realizes the value; on
    an already contiguous tensor it computes nothing in eager mode.

    ``torch._inductor.inductor_prims.force_stride_order``: checked on 2.13 and 2.14.1 (an
    op ``torch.ops.prims.inductor_force_stride_order`` registered when
    ``torch._inductor.inductor_prims`` is imported; 2.11 has it too). If it went, the
    value is returned as is and Inductor may recompute it (slower, same values)."""
    try:
        from torch._inductor import inductor_prims
    except ImportError:  # pragma: no cover - torch without Inductor
        return t
    op = getattr(inductor_prims, "force_stride_order", None)
    if op is None:  # pragma: no cover - a torch that dropped the prim
        return t
    t = t.contiguous()
    return op(t, t.stride())


def inductor_config_patch(**changes: Any) -> Any:
    """A context manager setting Inductor options (``torch._inductor.config.patch``).

    Checked on 2.13 for the options graphgear sets (``post_grad_fusion_options``,
    ``freezing``, ``cpp_wrapper``, ``size_asserts``, ``alignment_asserts``). If one went,
    ``patch`` raises and the static compile of the CPU/CUDA graphs fails."""
    from torch._inductor import config as inductor_config

    return inductor_config.patch(**changes)


def inductor_one_row_decompose_limit() -> int:
    """The widest weight (either dimension) whose one-row product Inductor's
    ``decompose_mm_pass`` turns into a fused reduction on the CPU; a wider one stays an
    ATen product (MKL's ``sgemv``).

    ``torch._inductor.fx_passes.decompose_mem_bound_mm.cpu_max_other_dimension_decomposition``
    (2048 in 2.11 to 2.14; read once when that module is imported, so a later
    ``post_grad_fusion_options`` patch does not change it). Only a routing heuristic
    depends on it: if it moved, 2048 is assumed."""
    try:
        from torch._inductor.fx_passes import decompose_mem_bound_mm as d
    except ImportError:
        return 2048
    return int(getattr(d, "cpu_max_other_dimension_decomposition", 2048))


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


def aot_forward_returns() -> int | None:
    """How many outputs of the training forward graph AOTAutograd is compiling now return
    to its caller (mutated inputs' new values, the user's outputs, RNG offsets); the
    ones after them are saved for the backward. None where no compile says.

    ``TracingContext.fw_metadata.num_forward`` (``ViewAndMutationMeta``): checked on 2.13
    (2.11 to 2.14). If it went, a padded training forward would slice its saved
    activations too, and its backward would refuse the call (sizes differ)."""
    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    n = getattr(meta, "num_forward", None)
    return n if isinstance(n, int) else None


def aot_tangents(gm: torch.fx.GraphModule) -> list[int]:
    """Indices of a backward graph's tangents (the gradients of the forward's outputs).

    AOTAutograd names them ``tangents_*``, the rule Inductor's ``count_tangents`` reads:
    checked on 2.13 (2.11 to 2.14)."""
    return [i for i, p in enumerate(gm.graph.find_nodes(op="placeholder")) if "tangents" in p.name]


def count_tangents(gm: torch.fx.GraphModule) -> int:
    """How many of a backward graph's inputs come before its tangents (the saved
    activations, which Inductor treats as static).

    ``torch._inductor.utils.count_tangents``: checked on 2.13; Inductor's backward
    compiler uses it (2.11 to 2.14). If it moved, max-autotune's backward compile would
    fail."""
    from torch._inductor.utils import count_tangents as count

    return count(gm)


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


def inductor_remove_noop_ops(graph: torch.fx.Graph) -> None:
    """Inductor's post-grad removal of no-op views and copies, in place.

    ``torch._inductor.fx_passes.post_grad.remove_noop_ops``: checked on 2.13; Inductor's
    pattern matcher runs it on the graphs it traces in 2.13. If it moved, the joint-graph fusion patterns
    would stop matching graphs that carry such no-ops."""
    from torch._inductor.fx_passes.post_grad import remove_noop_ops

    remove_noop_ops(graph)


def inductor_virtual_fake_mode(fake_mode: Any) -> contextlib.AbstractContextManager[Any]:
    """Inductor's virtualized fake mode set to ``fake_mode`` (its pattern matcher traces
    replacements in it), a null context for None.

    ``torch._inductor.virtualized.V.set_fake_mode``: checked on 2.13; Inductor's
    ``compile_fx`` uses it (2.11 to 2.14). If it moved, replacement nodes would carry no
    fake values."""
    if fake_mode is None:
        return contextlib.nullcontext()
    from torch._inductor.virtualized import V

    return V.set_fake_mode(fake_mode)


def enable_python_dispatcher() -> contextlib.AbstractContextManager[Any]:
    """The Python dispatcher, on while tracing with ``make_fx`` over fake tensors with
    symbolic sizes (CompositeImplicit ops then decompose with SymInts, as AOTAutograd and
    Inductor's ``fwd_only`` trace them).

    ``torch._dispatch.python.enable_python_dispatcher``: checked on 2.13; AOTAutograd
    uses it (2.11 to 2.14). If it moved, graphgear's pre-grad fusions and decomposed
    attention replacements could not trace graphs with dynamic shapes."""
    from torch._dispatch.python import enable_python_dispatcher as enable

    return enable()


def pattern_matcher_pass(name: str) -> Any:
    """A new Inductor ``PatternMatcherPass`` (``.apply(graph)`` returns the match count).

    ``torch._inductor.pattern_matcher.PatternMatcherPass(pass_name=)``: checked on 2.13;
    Inductor's own ``split_cat`` passes build theirs so in 2.13. If it changed, graphgear's
    pattern fusions (and users' ``register_replacement`` patterns) would not run."""
    from torch._inductor.pattern_matcher import PatternMatcherPass

    return PatternMatcherPass(pass_name=name)


def register_pattern(search_fn: Callable[..., Any], replace_fn: Callable[..., Any],
                     example_inputs: Sequence[Any], matcher: Any, *, training: bool,
                     get_decomp_fn: Callable[[], Any], **kwargs: Any) -> None:
    """Trace ``search_fn`` / ``replace_fn`` (forward and backward together when
    ``training``, with ``joint_fwd_bwd``, else the forward alone with ``fwd_only``) and
    add the pair to ``matcher``, skipping a duplicate. ``kwargs``: ``extra_check``,
    ``scalar_workaround``.

    ``torch._inductor.pattern_matcher.register_replacement``, ``fwd_only``,
    ``joint_fwd_bwd``: checked on 2.13; Inductor registers its own fusions with them
    (2.11 to 2.14). If they changed, as :func:`pattern_matcher_pass`; the caller skips a
    pattern that fails to trace."""
    from torch._inductor.pattern_matcher import fwd_only, joint_fwd_bwd, register_replacement

    register_replacement(
        search_fn,
        replace_fn,
        example_inputs,
        joint_fwd_bwd if training else fwd_only,
        matcher,
        get_decomp_fn=get_decomp_fn,
        skip_duplicates=True,
        **kwargs,
    )


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


#: One argument of a call in a :class:`StraightLine`: ``("name", local)``, ``("value",
#: object)`` (a constant or a global of the generated module, resolved when read) or
#: ``("view", local, size, stride, offset)`` (an inline ``reinterpret_tensor``).
ArgSpec = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class StraightLine:
    """Inductor's generated Python ``call`` read as straight-line code: what a CPU graph
    needs to replay it as a fixed list of kernel calls (``capture/cpu_graph``).

    ``keep``: the indices of the caller's arguments passed on (``inductor_drop_args``),
    or None for all; ``params``: the local names the arguments are unpacked into;
    ``steps``: ``("alloc", name, size, stride, dtype)`` (one allocation, in order),
    ``("view", name, src, size, stride, offset)``, ``("alias", name, src)``,
    ``("del", names)``, ``("call", fn, args, kwargs)`` (a generated C++ kernel, or an
    ``extern_kernels`` function writing into ``out=``); ``outs``: the returned values as
    :data:`ArgSpec`; ``reinterpret``: the module's ``reinterpret_tensor``."""

    keep: tuple[int, ...] | None
    params: tuple[str, ...]
    steps: tuple[tuple[Any, ...], ...]
    outs: tuple[ArgSpec, ...]
    reinterpret: Callable[..., torch.Tensor]


class _NotStraight(Exception):
    pass


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError as e:
        raise _NotStraight(ast.unparse(node)) from e


def _is_generated_kernel(fn: Any) -> bool:
    """A C++ kernel of Inductor's Python wrapper: ``async_compile.cpp_pybinding`` loads
    each as a built-in function named ``kernel`` of an extension module of its own."""
    return isinstance(fn, types.BuiltinFunctionType) and fn.__name__ == "kernel"


def _read_call_body(body: list[ast.stmt], g: dict[str, Any]) -> tuple[tuple[str, ...], list[Any], list[ArgSpec]]:
    params: tuple[str, ...] | None = None
    steps: list[Any] = []
    local: set[str] = set()
    outs: list[ArgSpec] | None = None

    def arg(node: ast.expr) -> ArgSpec:
        if isinstance(node, ast.Name):
            if node.id in local:
                return ("name", node.id)
            if node.id in g:
                return ("value", g[node.id])
            raise _NotStraight(node.id)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "reinterpret_tensor":
            src, size, stride, offset = node.args
            if not isinstance(src, ast.Name) or src.id not in local or node.keywords:
                raise _NotStraight(ast.unparse(node))
            return ("view", src.id, _literal(size), _literal(stride), _literal(offset))
        return ("value", _literal(node))

    for st in body:
        if outs is not None:
            raise _NotStraight("code after return")
        if isinstance(st, ast.Assign) and len(st.targets) == 1:
            t, v = st.targets[0], st.value
            if isinstance(t, ast.Tuple) and isinstance(v, ast.Name) and v.id == "args" and params is None:
                if not all(isinstance(e, ast.Name) for e in t.elts):
                    raise _NotStraight(ast.unparse(st))
                params = tuple(e.id for e in t.elts)  # type: ignore[attr-defined]
                local.update(params)
                continue
            if not isinstance(t, ast.Name):
                raise _NotStraight(ast.unparse(st))
            if isinstance(v, ast.Name) and v.id in local:
                steps.append(("alias", t.id, v.id))
            elif isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in INDUCTOR_ALLOC_NAMES:
                size, stride, dtype = v.args
                if not (isinstance(dtype, ast.Attribute) and isinstance(dtype.value, ast.Name)
                        and dtype.value.id == "torch" and isinstance(getattr(torch, dtype.attr, None), torch.dtype)):
                    raise _NotStraight(ast.unparse(st))
                steps.append(("alloc", t.id, _literal(size), _literal(stride), getattr(torch, dtype.attr)))
            else:
                spec = arg(v)
                if spec[0] != "view":
                    raise _NotStraight(ast.unparse(st))
                steps.append(("view", t.id, *spec[1:]))
            local.add(t.id)
        elif isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
            c = st.value
            f = c.func
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "args" \
                    and f.attr == "clear" and not c.args:
                continue
            if isinstance(f, ast.Name) and f.id in ("assert_size_stride", "assert_alignment"):
                continue  # checks of the arguments: the CPU graph checks a rebound one itself
            if isinstance(f, ast.Name) and _is_generated_kernel(g.get(f.id)) and not c.keywords:
                steps.append(("call", g[f.id], tuple(arg(a) for a in c.args), {}))
            elif (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                  and f.value.id == "extern_kernels" and "extern_kernels" in g
                  and any(k.arg == "out" and isinstance(k.value, ast.Name) for k in c.keywords)
                  and all(k.arg is not None for k in c.keywords)):
                fn = getattr(g["extern_kernels"], f.attr)
                steps.append(("call", fn, tuple(arg(a) for a in c.args),
                              {k.arg: arg(k.value) for k in c.keywords}))
            else:
                raise _NotStraight(ast.unparse(st))
        elif isinstance(st, ast.Delete):
            if not all(isinstance(e, ast.Name) and e.id in local for e in st.targets):
                raise _NotStraight(ast.unparse(st))
            names = tuple(e.id for e in st.targets)  # type: ignore[attr-defined]
            local.difference_update(names)
            steps.append(("del", names))
        elif isinstance(st, ast.Return) and isinstance(st.value, ast.Tuple):
            outs = [arg(e) for e in st.value.elts]
            if any(o[0] == "value" for o in outs):
                raise _NotStraight("returns a global or constant")
        else:
            raise _NotStraight(ast.unparse(st)[:80])
    if params is None or outs is None:
        raise _NotStraight("no argument unpacking or no return")
    return params, steps, outs


def inductor_straight_line(compiled: Any) -> StraightLine | None:
    """Inductor's generated Python ``call`` as a :class:`StraightLine`, or None where it
    is anything else (a C++ wrapper, a partitioned graph, an ATen call that returns new
    tensors, a collective, a profiler hook...): the CPU graph then runs the generated
    ``call`` itself on every replay.

    Reads the source of the generated module's ``Runner.call`` (Inductor writes the
    module to its cache folder, so ``inspect`` finds it) and accepts only these
    statement forms, all checked on 2.13: ``a, b = args``; ``args.clear()``; ``buf =
    empty_strided_cpu(size, stride, torch.dtype)``; ``buf = reinterpret_tensor(src, size,
    stride, offset)``; ``buf = other``; ``del ...``; a call of a generated C++ kernel
    (positional arguments); ``extern_kernels.f(..., out=buf)``; ``assert_size_stride`` /
    ``assert_alignment``; ``return (...)`` of locals and their ``reinterpret_tensor``
    views. If Inductor's wrapper changes shape, this returns None (the CPU graph is then
    as fast as before, never wrong)."""
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
        tree = ast.parse(textwrap.dedent(inspect.getsource(call)))
        body = tree.body[0]
        if not isinstance(body, ast.FunctionDef) or [a.arg for a in body.args.args] != ["self", "args"]:
            raise _NotStraight("not call(self, args)")
        params, steps, outs = _read_call_body(body.body, g)  # type: ignore[arg-type]
    except (_NotStraight, OSError, TypeError, SyntaxError, ValueError, AttributeError) as e:
        log.debug("graphgear: Inductor's wrapper is not straight-line code (%s: %s)", type(e).__name__, e)
        return None
    return StraightLine(keep=None if keep is None else tuple(keep), params=params, steps=tuple(steps),
                        outs=tuple(outs), reinterpret=g["reinterpret_tensor"])


# --------------------------------------------------------------------------- settings


def has_triton() -> bool:
    """Whether Triton is importable and usable by Inductor.

    ``torch.utils._triton.has_triton``: checked on 2.13 (False on the CPU build); Inductor's
    scheduler checks it in 2.13. If it moved the call raises; the
    caller then takes Triton as missing and the CUDA graph captures the FX graph."""
    from torch.utils._triton import has_triton as triton

    return bool(triton())


def get_backed_size_oblivious() -> bool | None:
    """``torch.fx.experimental._config.backed_size_oblivious``, None where this torch has
    no such setting.

    Checked on 2.13; ``torch.fx.experimental.symbolic_shapes`` reads it in 2.13. If it went, a gear of
    size 1 would be 0/1-specialised by dynamo (a second graph) instead of sharing the
    dynamic one; graphgear then leaves the setting alone."""
    from torch.fx.experimental import _config

    return getattr(_config, "backed_size_oblivious", None)


def set_backed_size_oblivious(value: bool) -> None:
    """Set ``torch.fx.experimental._config.backed_size_oblivious`` (process-wide; see
    :func:`get_backed_size_oblivious`)."""
    from torch.fx.experimental import _config

    _config.backed_size_oblivious = value


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

    call.graphgear_keep = tuple(keep)  # type: ignore[attr-defined]  # read by inductor_straight_line

    class _Compiled:
        current_callable = staticmethod(call)

        def __call__(self, args: list[Any]) -> Any:
            return call(args)

    return _Compiled()


# --------------------------------------------------------------------------- precompile (cache.py)

try:  # checked on 2.13: torch.compile(...).aot_compile's protocol for a backend's result
    from torch._dynamo.aot_compile_types import SerializableCallable
except ImportError:  # torch < 2.10: no precompile; graphgear.cache then always compiles
    SerializableCallable = None  # type: ignore[assignment,misc]


def graph_pickle_dumps(gm: torch.fx.GraphModule) -> bytes:
    """Pickle an FX graph module with fake-tensor metadata (``torch.fx._graph_pickler``,
    what Inductor's compile subprocess uses; checked on 2.13)."""
    from torch.fx._graph_pickler import GraphPickler, Options

    return GraphPickler.dumps(gm, Options(ops_filter=None))


def graph_pickle_loads(data: bytes, allowed: Callable[[str, str], bool] | None = None,
                       substitutes: dict[tuple[str, str], Any] | None = None,
                       ) -> tuple[torch.fx.GraphModule, Any]:
    """The graph module of :func:`graph_pickle_dumps` and the fresh fake mode (with its
    own ShapeEnv) its placeholders' ``example_value`` live in. ``allowed(module, name)``:
    every global the data names must pass it (else ``pickle.UnpicklingError``), with
    ``GraphPickler``'s own unpickler (``_GraphUnpickler``, ``_UnpickleState``,
    ``patch_pytree_map_over_slice``: what ``GraphPickler.loads`` does; checked on 2.13).
    ``substitutes`` maps a global to the object to use in its place."""
    import io
    import pickle

    from torch._subclasses import FakeTensorMode
    from torch.fx import _graph_pickler as gp
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    if allowed is None:
        return gp.GraphPickler.loads(data, fake_mode), fake_mode

    class Restricted(gp._GraphUnpickler):
        def find_class(self, module: str, name: str) -> Any:
            if substitutes and (module, name) in substitutes:
                return substitutes[module, name]
            if not allowed(module, name):
                raise pickle.UnpicklingError(f"graphgear cache: global {module}.{name} is not allowed here")
            return super().find_class(module, name)

    with gp.patch_pytree_map_over_slice(), io.BytesIO(data) as stream:
        gm = Restricted(stream, gp._UnpickleState(fake_mode)).load()
    return gm, fake_mode


def tracing_with(fake_mode: Any) -> contextlib.AbstractContextManager[Any]:
    """``torch._guards.tracing`` with a fresh ``TracingContext`` on ``fake_mode``, as
    dynamo gives a backend (checked on 2.13)."""
    return torch._guards.tracing(torch._guards.TracingContext(fake_mode))


def autograd_cache_off() -> contextlib.AbstractContextManager[Any]:
    """``aot_compile`` forces AOTAutograd's bundled cache, which expects Inductor's
    ``OutputCode`` from every compiler; graphgear's compilers return their own callables,
    so it is switched off around graphgear's backend (checked on 2.13)."""
    return torch._functorch.config.patch(
        force_autograd_cache=False, bundled_autograd_cache=False, strict_autograd_cache=False,
        enable_autograd_cache=False, bypass_autograd_cache_key=False,
    )


def inductor_config_digest() -> str:
    """A sha256 of Inductor's settings (``torch._inductor.config.save_config_portable()``,
    the part of its config Inductor's own FX graph cache keys on; checked on 2.13): the
    compile cache's entries hold Inductor's code, so its settings are part of the key."""
    import hashlib

    import torch._inductor.config as inductor_config

    items = sorted((k, repr(v)) for k, v in inductor_config.save_config_portable().items())
    return hashlib.sha256(repr(items).encode()).hexdigest()


def inductor_vec_isa_if_known() -> str | None:
    """The CPU vector ISA Inductor picked in this process (``str(pick_vec_isa())``, e.g.
    ``"avx512"``), or None when it has not probed yet (``valid_vec_isa_list`` not cached)
    or this is not an x86 CPU. Checked on 2.13 (``torch._inductor.cpu_vec_isa``); other
    versions not checked: if the names moved, None."""
    try:
        from torch._inductor import cpu_vec_isa

        if not _x86() or not _isa_probed(cpu_vec_isa):
            return None
        return str(cpu_vec_isa.pick_vec_isa())
    except (ImportError, AttributeError) as e:  # another torch: record nothing
        log.debug("graphgear: cannot read Inductor's vector ISA (%s)", e)
        return None


def adopt_vec_isa(recorded: str | None) -> bool:
    """Let Inductor skip its base ISA probes when a trusted record says which ISA it
    picked on this machine before; True when it did.

    Inductor decides which vector ISA to compile for by building a probe library per
    ISA and ``dlopen``-ing each in a child Python (``VecISA.check_build``): on a 2-core
    machine each child loads libtorch, about 0.6 s, four of them before the first C++
    kernel of a process can be looked up, cached or not. A compile-cache hit has the
    storing process's answer (``recorded``): when this CPU's flags make the same ISA the
    best candidate, Inductor's list is computed once with ``cpp.vec_isa_ok=True`` (its own
    switch that trusts the base probe; the AVX-512 bf16/VNNI and AMX extra probes still
    run) and must come out as ``recorded``. Nothing changes when Inductor already probed,
    when ``ATEN_CPU_CAPABILITY``, ``cpp.simdlen`` or ``cpp.vec_isa_ok`` steer it, or on
    other CPUs. Checked on 2.13 (``x86_isa_checker``, ``supported_vec_isa_list``,
    ``valid_vec_isa_list``); other versions not checked: if the names moved, False
    (Inductor probes as usual)."""
    try:
        return _adopt_vec_isa(recorded)
    except (ImportError, AttributeError) as e:  # another torch: Inductor probes as usual
        log.debug("graphgear: cannot hand Inductor a recorded vector ISA (%s)", e)
        return False


def _x86() -> bool:
    import platform

    return platform.machine() in ("x86_64", "AMD64")


def _isa_probed(cpu_vec_isa: Any) -> bool:
    """Whether Inductor already computed its vector-ISA list in this process."""
    return bool(cpu_vec_isa.valid_vec_isa_list.cache_info().currsize)


def _adopt_vec_isa(recorded: str | None) -> bool:
    import os

    import torch._inductor.config as inductor_config
    from torch._inductor import cpu_vec_isa

    if (not recorded or not _x86() or os.environ.get("ATEN_CPU_CAPABILITY")
            or inductor_config.cpp.simdlen is not None or inductor_config.cpp.vec_isa_ok is not None
            or _isa_probed(cpu_vec_isa)):
        return False
    flags = cpu_vec_isa.x86_isa_checker()
    candidates = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
    if not candidates or str(candidates[0]) != recorded:
        return False
    with inductor_config.patch({"cpp.vec_isa_ok": True}):
        picked = str(cpu_vec_isa.pick_vec_isa())
    if picked != recorded:  # an extra probe failed here: the kernels' keys differ, they compile
        log.info("graphgear: Inductor picked vector ISA %s, the cache entry recorded %s", picked, recorded)
    return picked == recorded


def serializable_guard_filter(unpicklable_free: Sequence[str] = ()) -> Callable[[Sequence[Any]], list[bool]]:
    """A ``guard_filter_fn`` for ``aot_compile``: its default (drop guards on globals and
    guard types torch cannot serialise, ``CheckFunctionManager.
    UNSUPPORTED_SERIALIZATION_GUARD_TYPES``), also dropping

    * guards whose *derived* types torch cannot serialise (checked on 2.13: transformers'
      ``check_model_inputs`` wrapper reads ``func.__code__``, and dynamo guards that code
      object by id, which ``save_compiled_function`` refuses);
    * guards whose source goes *through* a function held in a closure (a decorated
      method's inner function: ``...__closure__[1].cell_contents.__name__``, or a path
      from the free variables ``unpicklable_free`` of the traced function): torch
      stores such a function as missing, and rebuilding the guard in a later process
      fails. Guards on a closure cell's own value (a decorator's flag) are kept.

    What the dropped guards protected (the traced code itself) the compile cache checks
    instead, by source: :func:`changed_traced_sources`; a method replaced at run time
    (monkeypatched) is not seen, as with torch's own ``aot_compile`` filter, which drops
    identity guards too."""
    import re

    from torch._dynamo.guards import CheckFunctionManager

    bad = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    free = set(unpicklable_free)
    through = re.compile(r"__closure__\[\d+\]\.cell_contents[.\[]")

    def keep(g: Any) -> bool:
        if g.is_global or g.guard_type in bad or any(t in bad for t in g.derived_guard_types):
            return False
        root = re.split(r"[.\[]", g.name, maxsplit=1)[0]
        return not (root in free or through.search(g.name))

    def guard_filter(entries: Sequence[Any]) -> list[bool]:
        return [keep(g) for g in entries]

    return guard_filter


def changed_traced_sources(compiled: Any) -> list[str]:
    """The traced functions (``module:first-last``) whose source lines differ now from
    when ``compiled`` (an ``AOTCompiledFunction``) was traced: its ``source_info()``
    keeps a sha256 of every function dynamo inlined (``InlinedSource``; compared as
    ``torch._dynamo.package._hash_sourcelines`` computes it; checked on 2.13)."""
    import importlib

    from torch._dynamo.package import _hash_sourcelines

    changed = []
    for src in sorted(compiled.source_info().inlined_sources, key=lambda s: (s.module, s.firstlineno)):
        where = f"{src.module}:{src.firstlineno}-{src.lastlineno}"
        try:
            module = importlib.import_module(src.module)
            same = _hash_sourcelines(module, src.firstlineno, src.lastlineno) == src.checksum
        except Exception:
            same = False
        if not same:
            changed.append(where)
    return changed


def aot_bundling(tag: str) -> contextlib.AbstractContextManager[Any]:
    """The settings under which AOTAutograd keeps a bundled, serialisable entry of a
    compile (``compiled_fn.serialize()``), as torch's ``aot_compile`` sets them for
    Inductor (checked on 2.13): ``bundled_autograd_cache`` (the entry holds the
    compiler's ``OutputCode`` itself), ``enable_autograd_cache`` (without it no entry is
    made), ``bypass_autograd_cache_key`` (a random key where the graph cannot be hashed),
    and ``cache_key_tag`` + ``tag``, part of AOTAutograd's key: AOTAutograd also writes
    the entry to its on-disk cache (``<inductor cache>/aotautograd``), and its key does
    not include the compiler, so the tag keeps any other compile of the same graph (another
    graphgear config, Inductor's precompile) from being served graphgear's entry."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._functorch.config.patch(
        bundled_autograd_cache=True, enable_autograd_cache=True, bypass_autograd_cache_key=True,
        strict_autograd_cache=False, force_autograd_cache=False))
    stack.enter_context(torch.compiler.config.patch(
        cache_key_tag=f"{torch.compiler.config.cache_key_tag}{tag}"))
    return stack


def serializable_compiler(fn: Callable[..., Any]) -> Any:
    """``fn`` as ``torch._functorch._aot_autograd.schemas.SerializableAOTDispatchCompiler``:
    AOTAutograd makes a bundled entry only for a forward compiler of that type (checked
    on 2.13; Inductor's ``compile_fx`` wraps its compilers the same way)."""
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler

    return SerializableAOTDispatchCompiler(OutputCode, fn)


def bundled_entry_outputs(entry: Any) -> list[Any]:
    """The compilers' ``OutputCode`` objects a bundled AOTAutograd entry holds
    (``BundledAOTAutogradResult.compiled_fw/compiled_bw.result``; checked on 2.13)."""
    out = []
    for part in (getattr(entry, "compiled_fw", None), getattr(entry, "compiled_bw", None)):
        res = getattr(part, "result", None)
        if res is not None:
            out.append(res)
    return out


def load_bundled_entry(entry: Any) -> Callable[..., Any]:
    """AOTAutograd's runtime wrappers rebuilt around a bundled entry, without tracing
    (``aot_autograd_result.deserialize_bundled_cache_entry``, what torch's
    ``load_compiled_function`` does for Inductor's entries; checked on 2.13). Returns a
    function of the graph's inputs with a ``serialize()`` giving the entry again."""
    from torch._functorch._aot_autograd.aot_autograd_result import deserialize_bundled_cache_entry

    return deserialize_bundled_cache_entry(entry)


def aot_compiled_backend_result(compiled: Any) -> Any:
    """The backend's result inside torch's ``AOTCompiledFunction``
    (``_artifacts.compiled_fn``; checked on 2.13)."""
    return compiled._artifacts.compiled_fn


def inductor_output_for_disk(compiled: Any) -> Any:
    """A copy of Inductor's compiled graph (``CompiledFxGraph``) ready to pickle: no
    loaded module, source code and metadata kept (``prepare_for_serialization``, as
    AOTAutograd's bundled entries and the FX graph cache store it; checked on 2.13).
    ``compiled`` itself keeps running."""
    import copy

    from torch._inductor.output_code import CompiledFxGraph

    if not isinstance(compiled, CompiledFxGraph):
        raise TypeError(f"not Inductor's CompiledFxGraph: {type(compiled).__name__}")
    disk = copy.copy(compiled)
    disk.prepare_for_serialization()
    return disk


def inductor_output_load(graph: Any, *, is_inference: bool, is_backward: bool = False) -> Any:
    """Make an unpickled ``CompiledFxGraph`` runnable: import its generated module from
    Inductor's code cache (writing the source there first) and run its post-compile
    steps (input realignment), as AOTAutograd's bundled loader does
    (``FxGraphCache.cache_hit_post_compile`` + ``CompiledFxGraph.post_compile``; checked
    on 2.13). The C++ kernels its source names are loaded from Inductor's on-disk cache
    by the hash of their source, or compiled when missing.

    A generated module already in the code cache whose text differs from
    ``graph.source_code`` (which the caller verified) is overwritten with that source
    first, with a warning: the file imported is the text verified. (Before 2026-12-04 it
    was refused and the key compiled again, but Inductor's compile gave the same path
    and imported the file that was there: the edited code ran.)"""
    from torch._inductor.codecache import FxGraphCache, get_path
    from torch._inductor.output_code import CompiledFxGraph, CompiledFxGraphConstants
    from torch._inductor.utils import BoxedBool

    if not isinstance(graph, CompiledFxGraph):
        raise TypeError(f"not Inductor's CompiledFxGraph: {type(graph).__name__}")
    path = get_path(graph.cache_key, "py")[2]
    try:
        with open(path, encoding="utf-8") as f:
            on_disk = f.read()
    except FileNotFoundError:
        on_disk = None
    if on_disk != graph.source_code:
        if on_disk is not None:
            log.warning("graphgear cache: Inductor's code cache file %s differs from the entry's "
                        "verified source; writing the verified source over it", path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(graph.source_code)
        os.replace(tmp, path)
    constants = CompiledFxGraphConstants()
    loaded, _ = FxGraphCache.cache_hit_post_compile(graph, {}, constants)
    if loaded is None:
        raise RuntimeError("Inductor could not load the generated module of a stored graph")
    loaded.post_compile([], constants, {"cudagraphs": BoxedBool(False), "is_backward": is_backward,
                                        "is_inference": is_inference})
    return loaded


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


# ------------------------------------------------------- private attributes of public objects


def op_schema(op: OpOverload) -> Any:
    """``op._schema`` (its ``FunctionSchema``: arguments, alias info). Checked on 2.13;
    used by torch's own ``torch._library``/functionalization. Without it graphgear cannot
    tell which arguments an op writes (KV caches) or recover in-place ops."""
    return op._schema


def op_name(op: OpOverload) -> str:
    """``aten.add`` for ``aten.add.Tensor`` (``namespace`` + ``_opname``; checked on 2.13).
    Names ops in ``stats()`` fallbacks and the op summary."""
    return f"{op.namespace}.{op._opname}"


def op_overload_name(op: OpOverload) -> str:
    """``Tensor`` for ``aten.add.Tensor`` (``_overloadname``; checked on 2.13)."""
    return op._overloadname


def op_packet_name(packet: OpOverloadPacket) -> str:
    """``aten.add`` for the packet ``aten.add`` (``_qualified_op_name``; checked on 2.13)."""
    return packet._qualified_op_name.replace("::", ".")


def node_erased(node: torch.fx.Node) -> bool:
    """Whether ``node`` was removed from its graph (``fx.Node._erased``; checked on 2.13)."""
    return bool(node._erased)


def make_fx_allowing_real_inputs(fn: Any, **kwargs: Any) -> Any:
    """``make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True, ...)``: trace with
    fake tensors made from real example inputs (checked on 2.13)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True, **kwargs)

"""Precompile and the compile cache's storage (``graphgear.cache``, ``graphgear.artifacts``,
``graphgear.bundle``): FX graph pickling (``torch.fx._graph_pickler``), AOTAutograd's
bundled cache entries and their settings (``torch._functorch``), Inductor's
``OutputCode`` / ``CompiledFxGraph`` written to and loaded from disk, a digest of
Inductor's config, and the guard filter and traced-source check of
``torch.compile(...).aot_compile`` (``torch._dynamo``).

Checked on 2.13 (CPU build) and 2.14.1; torch < 2.10 has no precompile
(``SerializableCallable`` is None, and the compile cache then always compiles). If these
moved, the compile cache could not store or load an entry (it compiles instead), or
would key entries without Inductor's settings; each wrapper has its note.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch

# torch._inductor.output_code.OutputCode: checked on 2.13 (the base of Inductor's
# CompiledFxGraph and of dynamo's AOTEagerOutputCode, 2.11 to 2.14); importing it costs
# ~20 ms. AOTAutograd's bundled cache entry holds a compiler's result only when it is
# one (``AOTAutogradCache.make_entry``); graphgear's bundled result subclasses it.
from torch._inductor.output_code import OutputCode

log = logging.getLogger(__name__)

__all__ = [
    "DYNAMO_GLOBAL_PREFIXES",
    "OutputCode",
    "SerializableCallable",
    "aot_bundling",
    "aot_compiled_backend_result",
    "autograd_cache_off",
    "bundled_entry_outputs",
    "changed_traced_sources",
    "graph_pickle_dumps",
    "graph_pickle_loads",
    "inductor_config_digest",
    "inductor_output_for_disk",
    "inductor_output_load",
    "load_bundled_entry",
    "serializable_compiler",
    "live_global_names",
    "refresh_live_globals",
    "runtime_globals",
    "serializable_guard_filter",
]


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


def serializable_guard_filter(unpicklable_free: Sequence[str] = (),
                              on_identity_global: Callable[[str, Any, Any], None] | None = None,
                              ) -> Callable[[Sequence[Any]], list[bool]]:
    """A ``guard_filter_fn`` for ``aot_compile``: drop the guard types torch cannot
    serialise (``CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES``: identity
    guards), also dropping

    * guards whose *derived* types torch cannot serialise (checked on 2.13: transformers'
      ``check_model_inputs`` wrapper reads ``func.__code__``, and dynamo guards that code
      object by id, which ``save_compiled_function`` refuses);
    * guards whose source goes *through* a function held in a closure (a decorated
      method's inner function: ``...__closure__[1].cell_contents.__name__``, or a path
      from the free variables ``unpicklable_free`` of the traced function): torch
      stores such a function as missing, and rebuilding the guard in a later process
      fails. Guards on a closure cell's own value (a decorator's flag) are kept.

    * guards on an object of a class defined in local scope that defines its own
      ``__reduce__`` (it pickles by name), and every guard whose source goes through one
      (checked on 2.13 with transformers 5.25: the ``kernels`` package, a transformers
      requirement, makes ``apply_rotary_pos_emb`` an instance of
      ``_create_func_module.<locals>.Func`` and keeps it in each attention module's
      ``_kernel_funcs``; dynamo guards its type, and its guard-state pickler refuses any
      local class, so no Llama, Qwen2 or Mistral could be stored). Such an object is then
      pickled as missing, as torch does for values outside the guard tree. A local class
      without its own ``__reduce__`` (a model class defined in a function) keeps its
      guards, and the function stays uncached.

    What the dropped guards protected (the traced code itself) the compile cache checks
    instead, by source: :func:`changed_traced_sources`; a method replaced at run time
    (monkeypatched) is not seen, as with torch's own ``aot_compile`` filter, which drops
    identity guards too.

    Guards on globals (``G['SCALE']``, a global tensor's spec, a global flag, a global
    model's attributes) are kept, unlike ``aot_compile``'s default filter (which drops
    every guard on a global: a changed global then hit the entry silently, issue 43);
    they are checked against the live globals (:func:`refresh_live_globals`). Each
    *identity* guard on a global that is dropped is reported to
    ``on_identity_global(guard name, guarded value, root value or None)``: the compile
    cache checks it by name, or refuses to store the function (checked on 2.13:
    ``GuardFilterEntry.name`` is ``G['<name>']...`` for a global)."""
    import re

    from torch._dynamo.guards import CheckFunctionManager

    bad = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    free = set(unpicklable_free)
    through = re.compile(r"__closure__\[\d+\]\.cell_contents[.\[]")

    def keep(g: Any, values: dict[str, Any]) -> bool:
        if g.guard_type in bad or any(t in bad for t in g.derived_guard_types):
            if g.is_global and on_identity_global is not None:
                root = re.search(r"G\['[^']*'\]", g.name)
                on_identity_global(g.name, g.value, values.get(root.group()) if root else None)
            return False
        root = re.split(r"[.\[]", g.name, maxsplit=1)[0]
        return not (root in free or through.search(g.name))

    def pickles_itself(v: Any) -> bool:  # a local class that says how to pickle it (by name)
        t = type(v)
        return "<locals>" in getattr(t, "__qualname__", "") and "__reduce__" in vars(t)

    def guard_filter(entries: Sequence[Any]) -> list[bool]:
        local = {g.name for g in entries if pickles_itself(g.value)}
        values = {g.name: g.value for g in entries if g.is_global}
        return [keep(g, values) and not any(n in g.name for n in local) for g in entries]

    return guard_filter


#: names dynamo itself puts into the compiled function's globals (import aliases, the
#: backend's result, modules by id, builtins): never a user's global
DYNAMO_GLOBAL_PREFIXES = ("__import_", "__compiled_fn", "___", "__builtins_dict__", "__builtins__")


def runtime_globals(compiled: Any) -> dict[str, Any]:
    """The globals of the function dynamo's transformed bytecode runs in, for an
    ``AOTCompiledFunction`` (``compiled.fn.__globals__``; checked on 2.13 and 2.14.1).

    It is a *copy*: ``GraphRuntimeEnv.forward_callable`` builds a new dict of the import
    aliases, the globals the graph's inputs come from (``runtime_env.used_globals``: a
    global tensor, a global model) and, in the compiling process, every global of the
    traced function's module at compile time. The guard manager of a loaded function
    (``load_guard_manager(..., self.fn.__globals__)``) checks guards on globals against
    that copy too. Left alone, a global rebound later (or another process's value of it)
    would be neither read nor checked: :func:`refresh_live_globals` copies the live values
    in before each check."""
    return compiled.fn.__globals__


def live_global_names(compiled: Any) -> tuple[list[str], dict[str, Any]]:
    """The user globals ``compiled`` reads or guards (``runtime_env.used_globals`` and the
    global scope its guards were built on, ``GuardsState.output_graph.global_scope``;
    checked on 2.13 and 2.14.1), and of them those the bytecode reads (a graph input's
    source) with their values at compile time."""
    from torch._dynamo.package import load_guards_state

    used = dict(compiled._artifacts.runtime_env.used_globals)
    names = set(used)
    with contextlib.suppress(Exception):  # no guard state: the bytecode's globals alone
        names |= set(load_guards_state(compiled._artifacts.guards_state).output_graph.global_scope)
    keep = sorted(n for n in names if not n.startswith(DYNAMO_GLOBAL_PREFIXES))
    return keep, {n: used[n] for n in keep if n in used}


def refresh_live_globals(names: Sequence[str], live: dict[str, Any], target: dict[str, Any]) -> None:
    """Copy the live values of ``names`` from ``live`` (the traced function's module
    globals) into ``target`` (:func:`runtime_globals`); a name the module no longer has is
    removed (a guard on it then fails, as a read of it would)."""
    for name in names:
        try:
            target[name] = live[name]
        except KeyError:
            target.pop(name, None)


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

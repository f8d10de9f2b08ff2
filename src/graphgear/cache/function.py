"""The compile cache's wrapper: :func:`cache_compile` and :class:`CachedFunction`.

On a call with an input spec it has no entry for, the wrapper builds the cache key
(:mod:`graphgear.cache.key`), and either loads a trusted entry (``stats()``:
``cache="hit"``; :mod:`graphgear.cache.entry`) or compiles with torch's precompile
(``torch.compile(fn, fullgraph=True).aot_compile(...)``, :mod:`graphgear.cache.precompile`)
and stores the result (``"stored"``). A key compiled at run time (a gear the entry did
not hold) compiles as usual, and the entry is stored again after that call: once per
new key, never per step.

**Guards.** Every call of a stored or loaded function checks dynamo's guards first
(``guard_check``, the same check ``torch.compile`` makes). Where they reject the call (a
module attribute or global changed, grad mode on for an inference entry), the function
runs through plain ``torch.compile`` with graphgear instead, with one warning: correct,
without the cache's start-up gain. Tensors marked by ``set_dim_gears`` are passed to the
entry without dynamo's dim markings (``_torch.dynamo.without_dim_markings``: torch 2.13's
serialised guards reject marked tensors); the entry's dims are already symbolic and
graphgear checks the gears itself.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import io
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._torch.dynamo import compile_session, without_dim_markings
from .._torch.fx import pytree
from .._torch.isa import adopt_vec_isa
from .._torch.serialize import (
    SerializableCallable,
    aot_compiled_backend_result,
    changed_traced_sources,
    live_global_names,
    serializable_guard_filter,
)
from ..backend import get_backend
from ..config import CompilerConfig
from ..gears import get_dim_gears, set_dim_gears
from ..stats import record_count, records_since
from .arguments import check_arguments, name_of, unguardable_reason, unsupported_fix, unsupported_reason
from .entry import SUFFIX, _differing, _read_header, _read_trusted, _write_entry
from .key import GearsOf, _digest, _signature, key_parts
from .precompile import (
    _CachedGraph,
    _caching_backend,
    _closure_objects,
    _global_objects,
    _GlobalIdentities,
    _LiveGlobals,
    _module_globals,
    _resolve,
    _unpicklable_free,
)
from .store import cache_folder, entry_folder

log = logging.getLogger(__name__)

__all__ = ["CachedFunction", "cache_compile"]


#: compiled entries a key may hold, each for other module state (its guards decide)
MAX_VARIANTS = 4


def _variant_key(key: str, variant: int) -> str:
    return key if variant == 0 else f"{key}-v{variant}"


def _with_gears(args_kwargs: Any, gears_of: GearsOf) -> Any:
    """``args_kwargs`` with each tensor that inherits gears (:meth:`CachedFunction._gears_of`)
    replaced by a view of it marked with them, for a compile of a later variant of the key:
    compiled from the plain tensor, its dims would be left to dynamo (a dynamic graph
    without gears), not the key's gears."""

    def mark(t: torch.Tensor) -> torch.Tensor:
        gears = gears_of(t)
        if not gears or get_dim_gears(t):
            return t
        view = t.view(t.shape)
        set_dim_gears(view, gears)
        return view

    return pytree.tree_map_only(torch.Tensor, mark, args_kwargs)


@dataclasses.dataclass
class _Stored:
    """What a key's entry file holds of the compiled function: its path (None: not
    written), the backend's graph, that graph's ``version()`` when last written, and the
    globals its identity guards name (``_GlobalIdentities.named``)."""

    path: str | None
    graph: _CachedGraph
    version: int
    named_globals: dict[str, str] = dataclasses.field(default_factory=dict)


class CachedFunction:
    """What :func:`cache_compile` returns: call it as the function (or module) itself."""

    def __init__(self, fn: Any, config: CompilerConfig, cache_dir: str | None, dynamic: bool,
                 rank: int | None) -> None:
        if SerializableCallable is None:
            raise RuntimeError("graphgear.cache_compile needs torch's precompile (torch >= 2.10).")
        self.fn = fn
        self.module: nn.Module | None = fn if isinstance(fn, nn.Module) else None
        self._func: Callable[..., Any] = type(fn).forward if isinstance(fn, nn.Module) else fn
        if self.module is None and inspect.ismethod(fn) and isinstance(fn.__self__, nn.Module):
            self.module = fn.__self__
            self._func = fn.__func__
        self.config = config.copy()
        self.cache_dir = cache_folder(cache_dir)
        self.dynamic = dynamic
        self.rank = rank
        # key -> its variants (AOTCompiledFunctions whose guards accept different module
        # states), or [the fallback / an _Unsupported]
        self._loaded: dict[str, list[Any]] = {}
        self._keys: dict[Any, tuple[str, dict[str, str]]] = {}  # call signature -> key
        self._stored: dict[str, _Stored] = {}  # variant key (_variant_key) -> its entry
        self._compiled: set[str] = set()  # variant keys compiled here (not loaded)
        self.stores = 0  # entry files written by this object (tests: not one per step)
        self._fallback: Any = None
        self._warned = False
        self._warned_unsupported = False
        self._leaf_gears: dict[Any, dict[int, dict[int, list[int]]]] = {}  # input TreeSpec -> leaf -> gears
        # id(compiled) -> what it checks of the live globals before its guards (issue 43)
        self._live: dict[int, _LiveGlobals] = {}
        # the traced function's module globals (None: a callable without them)
        self._globals: dict[str, Any] | None = getattr(self._func, "__globals__", None)

    def _accepts(self, compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """``compiled``'s guards accept this call, checked on the live globals."""
        live = self._live.get(id(compiled))
        if live is None:
            return bool(compiled.guard_check(*args, **kwargs))
        return live.accepts(compiled, *args, **kwargs)

    def _call(self, compiled: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.module is not None:
            return compiled(self.module, *args, **kwargs)
        return compiled(*args, **kwargs)

    def _gears_of(self, leaves: list[Any], spec: Any) -> GearsOf:
        """Gears per input tensor (``leaves``, ``spec``: the call's flattened inputs): its
        own (``set_dim_gears``), else those the tensor at the same place in an earlier call
        had (TorchAir's usage: gears are set on the first call's input, later sizes arrive
        as plain tensors and hit the same entry)."""
        remembered = self._leaf_gears.setdefault(spec, {})
        inherited: dict[int, dict[int, list[int]]] = {}
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                continue
            own = get_dim_gears(leaf)
            if own:
                remembered[i] = own
            elif i in remembered and all(d < leaf.dim() for d in remembered[i]):
                inherited[id(leaf)] = remembered[i]
        if not inherited:
            return get_dim_gears
        return lambda t: inherited.get(id(t)) or get_dim_gears(t)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # inference: entries are compiled under no_grad, and their guards check grad mode. A
        # call with an input that requires grad keeps grad mode (the guards then send it
        # through torch.compile, with autograd); the module's own parameters do not count.
        leaves, spec = pytree.tree_flatten((args, kwargs))
        wants_grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in leaves if isinstance(t, torch.Tensor))
        if wants_grad:
            return self._serve(args, kwargs, self._gears_of(leaves, spec))
        with torch.no_grad():
            return self._serve(args, kwargs, self._gears_of(leaves, spec))

    def _serve(self, args: tuple[Any, ...], kwargs: dict[str, Any], gears_of: GearsOf) -> Any:
        sig = _signature((args, kwargs), gears_of)
        known = self._keys.get(sig)
        if known is None:  # the full key (source, config, module...) once per signature
            parts = key_parts(self.fn, self.config, args, kwargs, self.dynamic, self.rank, gears_of)
            known = self._keys[sig] = (_digest(parts), parts)
        key, parts = known
        variants = self._loaded.get(key)
        if variants is None:
            # torch's precompile traces outside dynamo's compile lock; another thread's
            # trace meanwhile would corrupt FX's process-wide patch of Module.__call__
            with compile_session():
                variants = self._loaded.get(key)
                if variants is None:
                    variants = self._loaded[key] = [self._load_or_compile(key, 0, parts, args, kwargs)]
        if variants[0] is self._fallback or isinstance(variants[0], _Unsupported):
            return variants[0](*args, **kwargs)
        plain_args, plain_kwargs = pytree.tree_map_only(torch.Tensor, without_dim_markings, (args, kwargs))
        call_args = (self.module, *plain_args) if self.module is not None else plain_args
        compiled = next((c for c in variants if self._accepts(c, call_args, plain_kwargs)), None)
        if compiled is None:
            marked = _with_gears((args, kwargs), gears_of)  # compiled as the key's first entry was
            compiled = self._new_variant(key, parts, variants, marked, (call_args, plain_kwargs))
            if compiled is None:
                return self._run_uncached(plain_args, plain_kwargs)
        out = self._call(compiled, plain_args, plain_kwargs)
        vkey = _variant_key(key, variants.index(compiled))
        stored = self._stored.get(vkey)
        if stored is not None and stored.path is not None and stored.graph.version() != stored.version:
            self._store(compiled, key, parts, stored)  # it compiled a key it did not hold
        return out

    def _new_variant(self, key: str, parts: dict[str, str], variants: list[Any],
                     marked: tuple[tuple[Any, ...], dict[str, Any]],
                     plain: tuple[tuple[Any, ...], dict[str, Any]]) -> Any:
        """The variant of ``key`` whose guards accept this call, where none of
        ``variants`` does (the module's state differs from theirs: a transformers
        ``StaticCache`` made on the first call, an attribute set since): the next stored
        one, loaded, or a new one, compiled and stored; at most :data:`MAX_VARIANTS` a key.
        None past that (the call then runs uncached)."""
        call_args, call_kwargs = plain
        if torch.is_grad_enabled():
            return None  # entries are compiled under no_grad: none would accept grad mode
        with compile_session():
            for c in list(variants):  # another thread may have added the one that fits
                if self._accepts(c, call_args, call_kwargs):
                    return c
            while len(variants) < MAX_VARIANTS:
                c = self._load_or_compile(key, len(variants), parts, *marked)
                if c is self._fallback or isinstance(c, _Unsupported):
                    return None
                fresh = _variant_key(key, len(variants)) in self._compiled
                variants.append(c)
                if self._accepts(c, call_args, call_kwargs):
                    log.info("graphgear cache: %s: variant %d of key %s serves this call",
                             name_of(self.fn), len(variants) - 1, key[:12])
                    return c
                if fresh:
                    return None  # compiled for this very call and still rejecting it: no more
        return None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled (dynamo's guard state of a module that holds this wrapper, as TorchAir's
        pattern has it; ``torch.save`` of such a module) as a stateless placeholder: the
        wrapper's compiled entries, guard managers and locks cannot be pickled and must not
        travel. ``copy.deepcopy`` builds a fresh wrapper instead (``__deepcopy__``)."""
        return _UnpickledCachedFunction, (name_of(self.fn),)

    def __deepcopy__(self, memo: dict[int, Any]) -> CachedFunction:
        fn = self.fn
        if inspect.ismethod(fn):  # the copy of the module, if it is being copied
            fn = getattr(copy.deepcopy(fn.__self__, memo), fn.__func__.__name__)
        else:
            fn = copy.deepcopy(fn, memo)
        return CachedFunction(fn, self.config, self.cache_dir, self.dynamic, self.rank)

    def _uncached(self) -> Any:
        """``fn`` through plain ``torch.compile`` with graphgear (no cache). A bound method
        is compiled as the method: the module's own ``forward`` may call this wrapper."""
        if self._fallback is None:
            self._fallback = torch.compile(self.fn, backend=get_backend(self.config),
                                           dynamic=None if self.dynamic else False)
        return self._fallback

    def _run_uncached(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The guards of every variant of the key reject this call: run it through plain
        torch.compile."""
        if not self._warned:
            self._warned = True
            log.warning("graphgear cache: the guards of every compiled entry of %s for this input "
                        "spec reject this call (module state or globals that differ from each "
                        "entry's; a spec holds at most %d entries, one per state); it runs through "
                        "torch.compile with graphgear instead, without the cache. Fix: keep the "
                        "module's attributes to a few states between calls.", name_of(self.fn),
                        MAX_VARIANTS)
        return self._uncached()(*args, **kwargs)

    def _entry_path(self, folder: str, key: str, variant: int) -> str:
        tail = f"-v{variant}" if variant else ""
        return os.path.join(folder, f"{name_of(self.fn)}-{key[:24]}{tail}{SUFFIX}")

    def _load_or_compile(self, key: str, variant: int, parts: dict[str, str], args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> Any:
        folder, reason = entry_folder(self.cache_dir, self.rank)
        if reason is not None:
            log.warning("graphgear cache: not using folder %s: %s; compiling without the cache", folder, reason)
            return self._compile(args, kwargs, None, key, parts, variant)
        path = self._entry_path(folder, key, variant)
        n0 = record_count()
        t0 = time.perf_counter()
        if os.path.lexists(path):
            try:
                header, payload = _read_trusted(path)
                diff = _differing(header["parts"], parts)
                if header.get("key") != key or diff:
                    raise ValueError(f"its key parts differ ({', '.join(diff) or 'key'})")
                isa = header.get("vec_isa")
                adopt_vec_isa(isa if isinstance(isa, str) else None)
                named = header.get("globals") or {}
                identities = {}
                for name, qualified in named.items():  # a global bound to a named function or class
                    try:
                        identities[name] = _resolve(qualified)
                    except ValueError as e:
                        raise ValueError(f"global {name} of the traced code: {e}") from None
                # the enclosing global scope, as torch asks (a recompile's bytecode may
                # load a module global such as ``torch``), and the modules it installed by id
                compiled = torch.compiler.load_compiled_function(
                    io.BytesIO(payload), f_globals={**(self._globals or {}), **_module_globals(payload)},
                    external_data={**_closure_objects(self._func), **_global_objects(self._globals or {})})
                changed = changed_traced_sources(compiled)
                if changed:
                    raise ValueError(f"the source of traced code changed since it was stored: "
                                     f"{', '.join(changed[:5])}")
                compiled.disable_guard_check()  # __call__ checks them first, once
                self._live[id(compiled)] = _LiveGlobals(compiled, self._globals, identities)
                graph = aot_compiled_backend_result(compiled)
            except Exception as e:  # refuse, never run it: recompile
                log.warning("graphgear cache: refusing %s: %s; compiling instead", path, e)
                for rec in records_since(n0):  # graphs rebuilt before the refusal
                    rec.cache = "refused"
            else:
                seconds = time.perf_counter() - t0
                for rec in records_since(n0):
                    rec.cache, rec.cache_load_seconds = "hit", seconds
                log.info("graphgear cache: loaded %s in %.2f s", path, seconds)
                self._stored[_variant_key(key, variant)] = _Stored(path, graph, graph.version(), dict(named))
                return compiled
        else:
            self._log_miss(folder, parts)
        return self._compile(args, kwargs, path, key, parts, variant)

    def _log_miss(self, folder: str, parts: dict[str, str]) -> None:
        """One log line naming the key part that differs from the nearest entry of this function."""
        prefix = name_of(self.fn) + "-"
        best: list[str] | None = None
        for fname in os.listdir(folder):
            if not (fname.startswith(prefix) and fname.endswith(SUFFIX)):
                continue
            try:
                with open(os.path.join(folder, fname), "rb") as f:
                    stored = _read_header(f)["parts"]
            except (OSError, ValueError):
                continue
            diff = _differing(stored, parts)
            if best is None or len(diff) < len(best):
                best = diff
        if best is None:
            log.info("graphgear cache: miss for %s (no entry for it in %s)", name_of(self.fn), folder)
        elif not best:
            log.info("graphgear cache: miss for %s: a new entry for this key, for module state or "
                     "globals no stored entry's guards accept", name_of(self.fn))
        else:
            log.info("graphgear cache: miss for %s: key part(s) differ from the nearest entry: %s",
                     name_of(self.fn), ", ".join(best))

    def _compile(self, args: tuple[Any, ...], kwargs: dict[str, Any], path: str | None, key: str,
                 parts: dict[str, str], variant: int = 0) -> Any:
        n0 = record_count()
        dynamic = None if self.dynamic else False  # True: dims marked (set_dim_gears) are dynamic
        call_args = (self.module, *args) if self.module is not None else args
        identities = _GlobalIdentities(self._globals or {})
        guard_filter = serializable_guard_filter(_unpicklable_free(self._func), identities.report)
        try:
            with torch.no_grad():
                compiled = torch.compile(self._func, fullgraph=True, dynamic=dynamic,
                                         backend=_caching_backend(self.config, key),
                                         options={"guard_filter_fn": guard_filter},
                                         ).aot_compile((call_args, kwargs))
        except Exception as e:  # what torch's precompile cannot save is served uncached
            return self._unsupported(e, n0)
        if identities.unguardable:  # a global only dynamo's identity guard could check
            return self._unsupported(unguardable_reason(identities.unguardable), n0)
        compiled.disable_guard_check()  # __call__ checks them first, once
        self._live[id(compiled)] = _LiveGlobals(compiled, self._globals, identities.objects)
        stored = _Stored(path, aot_compiled_backend_result(compiled), -1, dict(identities.named))
        self._stored[_variant_key(key, variant)] = stored
        self._compiled.add(_variant_key(key, variant))
        status = "stored" if path is not None and self._store(compiled, key, parts, stored) else "miss"
        for rec in records_since(n0):
            rec.cache = status
        return compiled

    def _unsupported(self, error: Exception | str, n0: int) -> Any:
        """torch's precompile failed on ``fn`` (a class defined in local scope, an object in
        its guards or closure that cannot be pickled, a graph break under ``fullgraph``):
        the call is served through plain ``torch.compile`` with graphgear, uncached; one
        warning per wrapper, and ``stats()`` records ``cache="unsupported"``."""
        reason = error if isinstance(error, str) else unsupported_reason(error)
        if not self._warned_unsupported:
            self._warned_unsupported = True
            log.warning("graphgear cache: %s cannot be stored in the compile cache: %s. It runs "
                        "through torch.compile with graphgear, without the cache. Fix: %s",
                        name_of(self.fn), reason, unsupported_fix(reason))
        for rec in records_since(n0):  # records of the precompile that failed
            rec.cache, rec.cache_reason = "unsupported", reason
        return _Unsupported(self._uncached(), reason)

    def _store(self, compiled: Any, key: str, parts: dict[str, str], stored: _Stored) -> bool:
        """Write the entry (after a compile, and again after a call that compiled a graph
        key the entry did not hold: at most once per new key, never per step)."""
        path = stored.path
        assert path is not None
        version = stored.version = stored.graph.version()
        try:
            external = {**_closure_objects(self._func), **_global_objects(live_global_names(compiled)[1])}
            payload = type(compiled).serialize(compiled, external).serialized_data
            _write_entry(path, name_of(self.fn), key, parts, payload, {"globals": stored.named_globals})
        except Exception as e:  # a cache that cannot be written must not break serving
            log.warning("graphgear cache: could not store %s: %s", path, e)
            return False
        self.stores += 1
        log.info("graphgear cache: stored %s (%d compiled graph keys)", path, version)
        return True


class _Unsupported:
    """A key whose function torch's precompile could not save: the uncached
    ``torch.compile`` of it; graphs it compiles are recorded ``cache="unsupported"``."""

    def __init__(self, fallback: Callable[..., Any], reason: str) -> None:
        self.fallback, self.reason = fallback, reason

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        n0 = record_count()
        out = self.fallback(*args, **kwargs)
        for rec in records_since(n0):
            rec.cache, rec.cache_reason = "unsupported", self.reason
        return out


class _UnpickledCachedFunction:
    """What a pickled :class:`CachedFunction` becomes: it holds no compiled state, and
    calling it says how to get a working wrapper back."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"graphgear cache: this cache_compile wrapper of {self.name} was unpickled "
                           "(pickle or torch.save of the object that held it) and holds no compiled "
                           "code. Fix: call graphgear.inference.cache_compile(...) again on the "
                           "loaded object (TorchAir's pattern: in its __init__ or after loading).")


def cache_compile(fn: Any, *, config: CompilerConfig | None = None, cache_dir: str | None = None,
                  dynamic: bool = True, rank: int | None = None) -> CachedFunction:
    """Compile ``fn`` (a function, an ``nn.Module`` or a module's bound method) with
    graphgear through a compile cache; see :mod:`graphgear.cache`.

    ``dynamic=True`` keeps the dims marked by ``set_dim_gears`` dynamic (torch's
    ``dynamic=None``); ``False`` compiles every dim static. ``rank`` stores entries in a
    ``rank<N>`` sub-folder. Calls run under ``torch.no_grad()`` (the cache serves
    inference: outputs carry no autograd history) unless an input tensor requires grad in
    grad mode: that call runs through plain ``torch.compile``, with autograd.

    Gears set (``set_dim_gears``) on a tensor of the first call hold for the tensor at the
    same place in later calls, so later sizes can arrive as plain tensors. A call whose
    module state the entry's guards reject (an attribute set since, a transformers
    ``StaticCache`` made on the first call) gets an entry of its own for the same input
    spec, up to :data:`MAX_VARIANTS`. What torch's precompile cannot save (a class defined
    in local scope, an unpicklable object in the guards) is served uncached, with one
    warning and ``stats()``'s ``cache="unsupported"``.

    Raises ``TypeError`` or ``ValueError`` naming the argument, for an ``fn`` that is not
    callable or is a generator function, a ``config`` that is not a ``CompilerConfig``, a
    ``dynamic`` that is not a bool, a ``rank`` that is not ``None`` or an int >= 0."""
    check_arguments(fn, config, dynamic, rank)
    return CachedFunction(fn, config if config is not None else CompilerConfig(), cache_dir, dynamic, rank)

"""What torch's precompile needs around graphgear's backend to save and load a function.

* :class:`_CachedGraph`, the backend's result under ``aot_compile``: a
  ``SerializableCallable`` whose saved form is AOTAutograd's *bundled* entry of each
  graph (``_torch.serialize.aot_bundling``), with graphgear's
  :class:`~graphgear.cache.bundle.GraphgearOutputCode` as the compiled graph; loading it
  goes through the entry's restricted unpickler (:mod:`graphgear.cache.entry`).
* AOTAutograd writes its own copy of each entry into Inductor's cache folder
  (``aotautograd/``) under a key tagged with the cache entry
  (:func:`~graphgear.cache.artifacts.cache_tag`), so no other compile of the same graph
  is served it (:func:`_caching_backend`).
* the objects torch's precompile does not store and a later process passes back: the
  functions and modules in the traced function's closure that pickle cannot store by
  reference (``external_data``, :func:`_closure_objects`), the models and tensors the
  function reads as globals (:func:`_global_objects`), and the modules dynamo's
  bytecode loads as globals it installed by id (``f_globals``, :func:`_module_globals`).
* **globals** (:class:`_LiveGlobals`, :class:`_GlobalIdentities`): guards on the traced
  function's globals are kept and checked against the live module globals before every
  call, and the globals the graph reads (a global tensor, a global model) are read live,
  in the compiling process and in a later one (issue 43: a changed global was served the
  entry's stale value). An identity guard on a global (a function, a class, a builtin
  bound to a global) cannot be stored by torch: it is checked by name
  (``module:qualname``) instead; a global whose identity cannot be named (a lambda, an
  object guarded by id) makes the function unsupported by the cache.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import pickle
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .._torch.serialize import (
    DYNAMO_GLOBAL_PREFIXES,
    SerializableCallable,
    bundled_entry_outputs,
    live_global_names,
    load_bundled_entry,
    refresh_live_globals,
    runtime_globals,
)
from ..backend import get_backend
from ..config import CompilerConfig
from .artifacts import cache_tag
from .bundle import GraphgearOutputCode
from .entry import _RestrictedUnpickler

__all__: list[str] = []


def _by_name(obj: Any) -> bool:
    """Whether pickle can store ``obj`` by reference (its module and qualified name lead
    back to it)."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    target: Any = module
    for part in (getattr(obj, "__qualname__", "") or "<none>").split("."):
        target = getattr(target, part, None)
    return target is obj


def _closure_cells(func: Any) -> Iterator[tuple[int, str, Any]]:
    """``(cell index, free variable name, value)`` for each closure cell of ``func``
    (empty cells skipped)."""
    names = getattr(getattr(func, "__code__", None), "co_freevars", ())
    for i, cell in enumerate(getattr(func, "__closure__", None) or ()):
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        yield i, names[i] if i < len(names) else "", v


def _closure_functions(func: Any) -> Iterator[tuple[int, str, Any]]:
    """The closure cells of ``func`` that hold a function."""
    return ((i, name, v) for i, name, v in _closure_cells(func) if inspect.isfunction(v))


def _unpicklable_free(func: Any) -> list[str]:
    """The free variables of ``func`` holding functions pickle cannot store by name."""
    return [name for _, name, v in _closure_functions(func) if not _by_name(v)]


def _closure_objects(func: Any) -> dict[str, Any]:
    """The functions in ``func``'s closure (and theirs, four deep) that pickle cannot
    store by reference (a decorated method's inner function: transformers' forwards), and
    the modules in those closures (a closure over a model).
    torch's precompile keeps the traced function's closure; these travel as its
    ``external_data`` instead, taken from the same places in a later process's function."""
    out: dict[str, Any] = {}

    def walk(f: Any, path: str, depth: int) -> None:
        for i, _, v in _closure_cells(f):
            if isinstance(v, nn.Module):  # a closure over a model: its weights are not stored
                out[f"{path}.{i}"] = v
            elif inspect.isfunction(v):
                if not _by_name(v):
                    out[f"{path}.{i}"] = v
                if depth < 4:
                    walk(v, f"{path}.{i}", depth + 1)

    walk(func, "closure", 0)
    return out


def _global_objects(values: dict[str, Any]) -> dict[str, Any]:
    """The models and tensors among ``values`` (globals the function reads), as
    ``external_data`` by name: torch's precompile cannot pickle a model, and a tensor's
    stored value would be stale anyway; a later process passes its own live ones."""
    return {f"global.{n}": v for n, v in values.items() if isinstance(v, (nn.Module, torch.Tensor))}


def _qualified(obj: Any) -> str | None:
    """``module:qualname`` of a function, class or builtin found again by that name (or
    ``module:name``: torch's builtins, ``torch.relu``, have the qualified name
    ``_VariableFunctionsClass.relu``, which ``torch`` does not export)."""
    if not (inspect.isroutine(obj) or inspect.isclass(obj)):
        return None
    module = getattr(obj, "__module__", None)
    if _by_name(obj):
        return f"{module}:{obj.__qualname__}"
    name = getattr(obj, "__name__", None)
    if module in sys.modules and name and getattr(sys.modules[module], name, None) is obj:
        return f"{module}:{name}"
    return None


def _resolve(qualified: str) -> Any:
    """The object ``module:qualname`` names in this process (``ValueError`` if none, or
    one that names itself otherwise: a rebound global)."""
    module, _, qualname = qualified.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{qualified} names nothing here ({e})") from None
    if _qualified(obj) != qualified:
        raise ValueError(f"{qualified} now names another object")
    return obj


@dataclasses.dataclass
class _GlobalIdentities:
    """The identity guards on globals the guard filter dropped (torch cannot store them):
    ``named``, global name -> ``module:qualname`` of the function, class or builtin it was
    bound to (checked per call, by identity with the object that name resolves to);
    ``unguardable``, guards on a global whose identity has no name (a lambda, an object
    guarded by id): the function is then not stored. Guards that reach code through a
    module (``G['torch'].sin``) or a builtin are left to the traced-source check, as
    torch's own ``aot_compile`` filter leaves them."""

    live: dict[str, Any]
    named: dict[str, str] = dataclasses.field(default_factory=dict)
    objects: dict[str, Any] = dataclasses.field(default_factory=dict)
    unguardable: list[str] = dataclasses.field(default_factory=list)

    def report(self, guard: str, value: Any, root_value: Any) -> None:
        m = re.search(r"G\['([^']*)'\]", guard)
        if m is None:  # no module global's value (torch's own filter drops it too)
            return
        root = m.group(1)
        if root.startswith(DYNAMO_GLOBAL_PREFIXES) or "type(" in guard[:m.start()]:
            return  # code reached through a module, or the class of a global (its code)
        if m.start() == 0 and m.end() == len(guard):
            root_value = value
        elif root_value is None:
            root_value = self.live.get(root)
        if inspect.ismodule(root_value):
            return
        name = _qualified(root_value)
        if name is None:
            if guard not in self.unguardable:
                self.unguardable.append(guard)
            return
        self.named[root], self.objects[root] = name, root_value


class _LiveGlobals:
    """What a compiled function checks of the traced function's live globals (``live``)
    before each guard check: it copies the values of the globals it reads or guards into
    the copy its bytecode and guards see (``_torch.serialize.runtime_globals``), and
    checks the named identities (:class:`_GlobalIdentities`)."""

    def __init__(self, compiled: Any, live: dict[str, Any] | None, identities: dict[str, Any]) -> None:
        self.names = live_global_names(compiled)[0] if live is not None else []
        self.live, self.identities = live, identities
        self.target = runtime_globals(compiled)

    def accepts(self, compiled: Any, *args: Any, **kwargs: Any) -> bool:
        if self.live is not None:
            refresh_live_globals(self.names, self.live, self.target)
            for name, obj in self.identities.items():
                if self.live.get(name) is not obj:
                    return False
        return bool(compiled.guard_check(*args, **kwargs))


_MODULE_GLOBAL = re.compile(rb"___module_([A-Za-z_][A-Za-z0-9_]*?)_[0-9]+_c[0-9]+")


def _module_globals(payload: bytes) -> dict[str, Any]:
    """The modules dynamo's bytecode in ``payload`` loads as globals it installed by id
    (``___module_<name>_<id>_c<n>``, ``codegen.create_load_python_module``: transformers'
    outputs reconstruct through ``collections``): torch's precompile does not store them,
    so they are passed back to ``load_compiled_function`` (``f_globals``). ``<name>`` is
    the module's last name part; one that names no loaded module, or several, is left
    out (torch then refuses the entry for the missing global, and it is recompiled)."""
    out: dict[str, Any] = {}
    for m in set(_MODULE_GLOBAL.finditer(payload)):
        name = m.group(1).decode()
        mod = sys.modules.get(name)
        if mod is None:
            found = [v for k, v in list(sys.modules.items()) if k.rsplit(".", 1)[-1] == name]
            mod = found[0] if len(found) == 1 else None
        if mod is not None:
            out[m.group(0).decode()] = mod
    return out


_Base: Any = SerializableCallable if SerializableCallable is not None else object


class _CachedGraph(_Base):  # type: ignore[misc,valid-type]
    """The result of graphgear's backend under ``aot_compile``: AOTAutograd's compiled
    function with its bundled entry (``compiled.serialize()``), whose graphs are
    graphgear's :class:`~graphgear.cache.bundle.GraphgearOutputCode` (``outputs``)."""

    def __init__(self, compiled: Callable[..., Any], outputs: list[GraphgearOutputCode]) -> None:
        self.compiled, self.outputs = compiled, outputs

    def version(self) -> int:
        """Moves when a graph compiles a key it did not hold (see ``artifacts``)."""
        return sum(o.store.version for o in self.outputs if o.store is not None)

    @classmethod
    def serialize_compile_artifacts(cls, fn: _CachedGraph) -> bytes:
        entry = fn.compiled.serialize()  # AOTAutograd's bundled entry, ready to pickle
        if entry is None:
            raise RuntimeError("AOTAutograd kept no bundled entry of this graph")
        return pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> _CachedGraph:
        entry = _RestrictedUnpickler(io.BytesIO(data)).load()
        outputs = [o for o in bundled_entry_outputs(entry) if isinstance(o, GraphgearOutputCode)]
        if not outputs:
            raise ValueError("the entry holds no graphgear graph")
        return cls(load_bundled_entry(entry), outputs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)


def _caching_backend(config: CompilerConfig, key: str) -> Callable[..., Any]:
    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> _CachedGraph:
        compiled, outputs = get_backend(config).compile_bundled(gm, example_inputs, cache_tag(key))
        return _CachedGraph(compiled, outputs)

    backend.__name__ = "graphgear_cache"
    return backend

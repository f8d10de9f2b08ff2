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
  reference (``external_data``, :func:`_closure_objects`), and the modules dynamo's
  bytecode loads as globals it installed by id (``f_globals``, :func:`_module_globals`).
"""

from __future__ import annotations

import inspect
import io
import pickle
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .._torch.serialize import SerializableCallable, bundled_entry_outputs, load_bundled_entry
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

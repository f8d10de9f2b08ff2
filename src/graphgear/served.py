"""A served model's calls without dynamo's frame evaluation (what
:func:`graphgear.inference.serve` returns).

A ``torch.compile``d model's call passes through ``OptimizedModule`` and two
``nn.Module`` call layers, dynamo's compile wrapper (a dozen thread-state switches) and
its frame evaluation (find the frame's cache, check each entry's guards, run the entry's
code in a new frame) before the compiled code starts. On a small decoder that is a
quarter of a served step: measured side by side in one process (2026-12-02, transformers
Qwen2 hidden 128, 2 layers, batch 1, 1 thread), the same served model took 245 µs a
step through dynamo and 189 µs through :class:`ServedModel` (0.77x).

:class:`ServedModel` makes dynamo's decision with dynamo's own objects and less Python:
it binds the call's arguments as the compiled frame's locals (as CPython would), checks
the guard managers of dynamo's cache entries for that frame (the same guards dynamo
checks; the entry of the last direct call first, then dynamo's most recently used
order) and calls the first passing entry's compiled code as a plain function. Every
call it cannot decide goes through dynamo unchanged, so the answer is never different
from ``torch.compile``'s:

- no entry's guards pass (dynamo compiles a new entry; later calls find it);
- the module has hooks, or global module hooks are set (``nn.Module.__call__`` would
  run them; the direct call would not);
- a call inside another compiled region or a trace, or under a compiler stance
  (``torch.compiler.set_stance``);
- arguments that do not bind to the frame's signature (dynamo's path raises Python's
  ``TypeError``);
- compiled code with a graph break (its resume functions need dynamo's frame
  evaluation), code whose function was changed since, a torch that cannot list dynamo's
  cache entries for the compile's ``isolate_recompiles`` region.

``direct_calls`` and ``dynamo_calls`` count the two paths. ``state_dict`` and
``load_state_dict`` are the model's (its own keys); everything else (attributes,
``eval()``, ``generate``) is the compiled object's (``torch.compile``'s result).

Weights loaded into the served model (``load_state_dict`` on it or on any of its
submodules) are new frozen weights: the next call compiles the model again, as
:func:`graphgear.inference.serve` did (``reserves`` counts it), instead of running code
that holds some of the old ones. ``copy.deepcopy`` of a served model serves a deep copy
of the model (its own compile); without the recipe to serve again it raises.
"""

from __future__ import annotations

import copy
import inspect
import logging
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ._torch.dynamo import (
    dynamo_code_function,
    dynamo_entries,
    dynamo_frame_active,
    dynamo_region,
    dynamo_served_codegen,
    module_call_hooks,
)

log = logging.getLogger(__name__)

__all__ = ["ServedModel"]


class _Binder:
    """Binds a call's arguments to a function's parameters the way CPython fills a new
    frame's locals (defaults applied, ``*args`` / ``**kwargs`` collected), plus the
    function's free variables: the ``f_locals`` dynamo's guards read. ``None`` where
    the call would not bind (CPython would raise)."""

    def __init__(self, fn: types.FunctionType) -> None:
        co = fn.__code__
        n, k = co.co_argcount, co.co_kwonlyargcount
        self.pos = co.co_varnames[:n]
        self.by_name = frozenset(self.pos[co.co_posonlyargcount:] + co.co_varnames[n:n + k])
        i = n + k
        self.varargs = co.co_varnames[i] if co.co_flags & inspect.CO_VARARGS else None
        i += self.varargs is not None
        self.varkw = co.co_varnames[i] if co.co_flags & inspect.CO_VARKEYWORDS else None
        defaults = fn.__defaults__ or ()
        self.defaults = dict(zip(self.pos[n - len(defaults):], defaults))
        self.defaults.update(fn.__kwdefaults__ or {})
        self.required = n + k
        self.free = tuple(zip(co.co_freevars, fn.__closure__ or ()))

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        pos = self.pos
        if len(args) > len(pos) and self.varargs is None:
            return None
        loc = dict(zip(pos, args))
        extra: dict[str, Any] = {}
        for name, value in kwargs.items():
            if name in self.by_name:
                if name in loc:
                    return None
                loc[name] = value
            elif self.varkw is not None:
                extra[name] = value
            else:
                return None
        for name, value in self.defaults.items():
            loc.setdefault(name, value)
        if len(loc) < self.required:
            return None
        if self.varargs is not None:
            loc[self.varargs] = tuple(args[len(pos):])
        if self.varkw is not None:
            loc[self.varkw] = extra
        try:
            for name, cell in self.free:
                loc[name] = cell.cell_contents
        except ValueError:  # an empty cell
            return None
        return loc


def _frame_function(target: Any) -> tuple[types.FunctionType | None, tuple[Any, ...]]:
    """The Python function whose frame dynamo compiles when ``target`` is called through
    ``torch.compile``, and the arguments it gets before the caller's (``self``)."""
    if isinstance(target, torch.nn.Module):
        target = target.forward
    if isinstance(target, types.MethodType) and isinstance(target.__func__, types.FunctionType):
        return target.__func__, (target.__self__,)
    if isinstance(target, types.FunctionType):
        return target, ()
    return None, ()


class _WeightsLoaded:
    """The ``load_state_dict`` post-hook a served model puts on each of its modules: marks
    the served model (held weakly) to compile again. A copy of the model (``deepcopy``)
    carries the hook: loads into modules that are not the served model's are ignored.
    Pickled (``torch.save(model)``) it becomes a hook that does nothing."""

    def __init__(self, served: ServedModel | None, module: torch.nn.Module | None) -> None:
        self._served = weakref.ref(served) if served is not None else None
        self._mine = weakref.WeakSet(module.modules()) if module is not None else weakref.WeakSet()

    def __call__(self, module: torch.nn.Module, incompatible: Any) -> None:
        served = self._served() if self._served is not None else None
        if served is not None and module in self._mine:
            served._weights_loaded = True

    def __reduce__(self) -> tuple[Any, ...]:
        return (_WeightsLoaded, (None, None))


class ServedModel:
    """``compiled`` (``torch.compile(target, ...)``) called without dynamo's frame
    evaluation where dynamo would run compiled code: see the module docstring.

    Around the calls that go through dynamo (where it compiles), dynamo generates code
    without its profiler ranges (``record_runtime_overhead``) and, with ``frozen`` (the
    target's parameters are final: ``frozen_parameter``), compiles the parameters into
    the graph instead of passing each as an input fetched on every call
    (``install_free_tensors``): :func:`graphgear._torch.dynamo.dynamo_served_codegen`."""

    def __init__(self, compiled: Callable[..., Any], target: Any, *, direct: bool = True,
                 frozen: bool = False, compile_again: Callable[[Any], Callable[..., Any]] | None = None) -> None:
        self._frozen = frozen
        self._target = target
        self._module = target if isinstance(target, torch.nn.Module) else None
        self._wanted_direct = direct
        # ``compile_again(target)``: a new ``torch.compile`` of ``target`` as this one was
        # made (weights loaded since, a deep copy); None: neither is possible
        self._compile_again = compile_again
        self._weights_loaded = False
        self.reserves = 0
        self.direct_calls = 0
        self.dynamo_calls = 0
        self._adopt(compiled)
        if frozen and self._module is not None and compile_again is not None:
            hook = _WeightsLoaded(self, self._module)
            for m in self._module.modules():
                m.register_load_state_dict_post_hook(hook)

    def _adopt(self, compiled: Callable[..., Any]) -> None:
        """Serve ``compiled`` (``torch.compile`` of the target)."""
        target, direct = self._target, self._wanted_direct
        self._compiled = compiled
        fn, self._prefix = _frame_function(target)
        self._fn = fn
        self._region = dynamo_region(compiled)
        self._code = fn.__code__ if fn is not None else None
        self._binder = _Binder(fn) if direct and fn is not None and self._region is not None else None
        self._direct: dict[types.CodeType, types.FunctionType | None] = {}
        # the compiled code of the last direct call: its guards are checked first (a
        # decode loop runs one entry; dynamo's own most-recently-used order only moves
        # on the calls that go through dynamo)
        self._last: types.CodeType | None = None
        if direct and self._binder is None:
            log.info("graphgear.served: %r has no direct path (%s); every call goes through dynamo",
                     type(target).__name__,
                     "no Python function to compile" if fn is None else "this torch has no isolate_recompiles")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._weights_loaded:
            self._serve_again()
        run = self._lookup(args, kwargs)
        if run is None:
            self.dynamo_calls += 1
            with dynamo_served_codegen(frozen=self._frozen):
                return self._compiled(*args, **kwargs)
        self.direct_calls += 1
        return run(*self._prefix, *args, **kwargs)

    def _lookup(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> types.FunctionType | None:
        """The compiled code dynamo would run for this call, as a function, or None
        where the call must go through dynamo."""
        binder, fn = self._binder, self._fn
        if binder is None or fn is None or dynamo_frame_active():
            return None
        if fn.__code__ is not self._code or (self._module is not None and (
                module_call_hooks(self._module)
                or getattr(self._module.forward, "__func__", None) is not fn)):
            return None
        entries = dynamo_entries(fn.__code__, self._region)  # type: ignore[arg-type]
        if not entries:
            return None
        f_locals = binder.bind(self._prefix + args, kwargs)
        if f_locals is None:
            return None
        last = self._last
        if last is not None and entries[0][1] is not last:
            for j, (_, code) in enumerate(entries):
                if code is last:
                    entries.insert(0, entries.pop(j))
                    break
        try:
            for guard, code in entries:
                if guard.check(f_locals):
                    self._last = code
                    return self._function(code)
        except Exception:  # noqa: BLE001 - a guard that raises: dynamo's path decides (and reports)
            log.debug("graphgear.served: a guard check raised; the call goes through dynamo", exc_info=True)
        return None

    def _function(self, code: types.CodeType) -> types.FunctionType | None:
        """dynamo's compiled code for the frame as a function of the frame's function's
        globals, defaults and closure (None for code with a graph break)."""
        try:
            return self._direct[code]
        except KeyError:
            pass
        fn = self._fn
        assert fn is not None
        run = dynamo_code_function(code, fn)
        if run is None:
            log.info("graphgear.served: %s has a graph break; its calls go through dynamo", fn.__qualname__)
        if len(self._direct) > 64:  # recompiles (graphgear.reset) leave dead entries
            self._direct.clear()
        self._direct[code] = run
        return run

    def _serve_again(self) -> None:
        """Weights were loaded into the served model: compile it again (its old code holds
        the old weights, in part: packed copies and constants)."""
        assert self._compile_again is not None
        log.info("graphgear.served: weights were loaded into %s after serve(): compiling it again",
                 type(self._target).__name__)
        self._weights_loaded = False
        self.reserves += 1
        self._adopt(self._compile_again(self._target))

    def __deepcopy__(self, memo: dict[int, Any]) -> ServedModel:
        if self._compile_again is None:
            raise TypeError(
                f"graphgear: this ServedModel of {type(self._target).__name__} cannot be deep-copied (it "
                f"was not made by graphgear.inference.serve); deep-copy the model and serve the copy.")
        target = copy.deepcopy(self._target, memo)
        return ServedModel(self._compile_again(target), target, direct=self._wanted_direct, frozen=self._frozen,
                           compile_again=self._compile_again)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The served model's ``state_dict`` (its own keys; ``torch.compile``'s wrapper
        would prefix them with ``_orig_mod.``)."""
        if self._module is None:
            return self._compiled.state_dict(*args, **kwargs)
        return self._module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        """Load into the served model (``model.load_state_dict``: the keys of
        ``model.state_dict()``); its next call compiles it again, as for a load into the
        model itself."""
        if self._module is None:
            return self._compiled.load_state_dict(state_dict, *args, **kwargs)
        return self._module.load_state_dict(state_dict, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_compiled", "_module", "_fn", "_target", "_compile_again"):
            raise AttributeError(name)
        return getattr(self._compiled, name)

    def __repr__(self) -> str:
        return f"ServedModel({self._compiled!r})"

"""One AOT graph run by graph key (:class:`KeyedGraph`): one compiled callable per key,
built on first use, with the rules for the graph's Python int inputs (a few values
each, then uncompiled; value-only ints share one key: :class:`ValueOnly`)."""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .._torch.aot import boxed_convention
from .._torch.dynamo import compile_session
from ..shapes import with_sizes
from ..stats import after_warm
from .facts import GraphFacts

log = logging.getLogger(__name__)

#: distinct values of a graph's Python int inputs (per shape) compiled before new ones
#: run uncompiled: an int that changes every call would otherwise compile every call
SCALAR_KEYS = 8

__all__ = ["SCALAR_KEYS", "KeyedGraph", "ValueOnly"]

#: builds the compiled boxed callable of one graph key
Build = Callable[[tuple[int, ...]], Callable[..., Any]]


@boxed_convention
class KeyedGraph:
    """Run-time dispatch of one AOT graph by graph key. Boxed (AOTAutograd calls it with
    one list of inputs), and so is each key's callable (an engine, Inductor's compiled
    graph): a replay is one call deep below AOTAutograd.

    ``build(key)`` returns the compiled boxed callable of one key (a static graph in
    max-autotune and reduce-overhead), called once per key, under the compile lock.
    ``per_key`` False: ``build`` returns one shared graph for every key. Past
    :data:`SCALAR_KEYS` values of the Python ints in ``facts.scalars`` per shape, a new
    value runs ``uncompiled`` (the graph as it is) instead of compiling once more.
    """

    def __init__(self, facts: GraphFacts, build: Build, *, per_key: bool = True,
                 uncompiled: Callable[[list[Any]], Any] | None = None, calls_to_build: int = 1) -> None:
        self.facts = facts
        self.info = facts.info
        self.build = build
        self.per_key = per_key
        self.uncompiled = uncompiled
        self.calls_to_build = calls_to_build  # calls that compile (and capture) one key
        self.scalars = list(facts.scalars)
        self.compiled: dict[tuple[int, ...], Callable[..., Any]] = {}
        self.warmed: set[tuple[int, ...]] = set()
        self._scalar_values: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
        self._storm_warned = False
        self._eager_keys: set[tuple[int, ...]] = set()  # new after mark_warm("eager"): uncompiled
        self._lock = threading.Lock()

    def __call__(self, args: list[Any]) -> Any:
        return self.get(self.info.key(args))(args)

    def get(self, key: tuple[int, ...]) -> Callable[..., Any]:
        """The boxed callable of ``key``, built on its first call."""
        fn = self.compiled.get(key)
        if fn is None and self.scalars and self.uncompiled is not None and self._scalar_storm(key):
            return self.uncompiled
        if fn is None and self.per_key and self._after_warm(key):
            return self.uncompiled  # type: ignore[return-value]
        if fn is None:
            # a run-time compile holds what dynamo holds around its own (see
            # ``compile_session``): other threads' calls wait instead of being refused
            with compile_session(), self._lock:
                fn = self.compiled.get(key)
                if fn is None:
                    fn = self.build(key)
                    self.compiled[key] = fn
        return fn

    def _after_warm(self, key: tuple[int, ...]) -> bool:
        """A new key after ``graphgear.mark_warm()`` (``stats.after_warm``): True when it
        runs uncompiled from now on (``"eager"``, where the graph can run as it is)."""
        if key in self._eager_keys:
            return True
        record = self.facts.record
        names = record.inputs if len(record.inputs) == len(self.info.placeholders) else [
            p.name for p in self.info.placeholders]
        where = [names[loc.arg] + ("" if loc.dim is None else f".shape[{loc.dim}]") for loc in self.info.locs]
        sizes = ", ".join(f"{w}={v}" for w, v in zip(where, key))
        source = f" ({record.source})" if record.source else ""
        eager = after_warm("key", f"{record.name}{source} met new sizes {sizes}",
                           "Precompile every gear before mark_warm() (graphgear.inference.precompile_gears), "
                           "or add the size to the gears (with gear_padding, sizes between gears are padded).")
        if eager and self.uncompiled is not None:
            self._eager_keys.add(key)
            return True
        return False

    def _scalar_storm(self, key: tuple[int, ...]) -> bool:
        """Whether ``key`` is one more value of the Python ints in :attr:`scalars` past
        :data:`SCALAR_KEYS` for its shapes (then it runs uncompiled, with one warning)."""
        scalars = set(self.scalars)
        shape = tuple(v for i, v in enumerate(key) if i not in scalars)
        value = tuple(key[i] for i in self.scalars)
        with self._lock:
            seen = self._scalar_values.setdefault(shape, set())
            if value in seen or len(seen) < SCALAR_KEYS:
                seen.add(value)
                return False
        if not self._storm_warned:
            self._storm_warned = True
            record = self.facts.record
            names = ", ".join(repr(self.info.placeholders[self.info.locs[i].arg].name) for i in self.scalars)
            reason = (f"Python int input(s) {names} took more than {SCALAR_KEYS} values, each a graph "
                      f"key of its own (a compile each); new values now run the graph uncompiled")
            record.add_fallback("graph key", reason)
            msg = (f"graphgear: {record.name}: {reason}. Pass such a number as a tensor "
                   f"(torch.tensor(n)) to compile once, or keep it constant.")
            warnings.warn(msg, UserWarning, stacklevel=2)
            log.warning(msg)
        return True

    def build_keys(self, args: Sequence[Any], keys: Iterable[tuple[int, ...]], progress: dict[str, Any]) -> None:
        """Compile (and in reduce-overhead capture) each of ``keys`` not built so far,
        with inputs made from ``args`` by zero-padding or narrowing the geared dims;
        inputs the graph mutates are restored afterwards. A key's callable with a
        ``precompile(args)`` method builds itself with it; another is called
        ``calls_to_build`` times. ``progress``: the state of ``precompile_gears``."""
        keys = [k for k in keys if k not in self.warmed]
        snapshot = {j: args[j].clone() for j in self.facts.mutated if isinstance(args[j], torch.Tensor)}
        bar = progress.get("bar")
        for key in keys:
            fn = self.get(key)
            resized = self.info.resized_args(args, key)
            with torch.no_grad():
                precompile = getattr(fn, "precompile", None)
                if callable(precompile):
                    precompile(list(resized))
                else:
                    for _ in range(self.calls_to_build):
                        fn(list(resized))
            self.warmed.add(key)
            if bar is not None:
                bar.update(1)
        for j, saved in snapshot.items():
            args[j].copy_(saved)


@boxed_convention
class ValueOnly:
    """``inner`` called with the value-only ints of ``facts`` (Python ints no tensor
    depends on) at their first values: the tensor work is the same for any value, so
    one key serves them all; the graph's SymInt outputs of them are computed per call
    at the real values."""

    def __init__(self, inner: Callable[[list[Any]], Any], facts: GraphFacts) -> None:
        self.inner = inner
        self.info = facts.info
        self.per_key = getattr(inner, "per_key", True)
        self.args = [(i, facts.info.locs[i].arg) for i in facts.value_only]
        self.outputs = list(facts.value_outputs)
        self._first: dict[int, Any] = {}

    def __call__(self, args: list[Any]) -> Any:
        real = self.info.key(args)
        for i, j in self.args:
            args[j] = self._first.setdefault(i, args[j])
        return with_sizes(self.inner(args), self.outputs, self.info.size_at(real))

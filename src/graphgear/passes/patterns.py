"""Pattern replacements, built on Inductor's pattern matcher.

A replacement is a pair of functions, ``search_fn`` and ``replace_fn``, with example
inputs. Both are traced to aten graphs the way graphgear's own graphs are made (with the
mode's decomposition table: Inductor's for ``max-autotune``, none for the other modes),
so a pattern written once matches in every mode. Tracing is lazy: a pattern is traced
the first time a graph of that kind is searched.

``graphgear.register_replacement(search_fn, replace_fn, example_inputs)`` adds a user
pattern to the post-grad ``pattern_fusion`` pass (``experimental_config.pattern_fusion_pass``).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from torch import fx

from .._torch.fx import fake_mode_of, tracing, unset_fake_temporarily
from .._torch.inductor_passes import (
    inductor_decomp_table,
    inductor_virtual_fake_mode,
    pattern_matcher_pass,
    register_pattern,
)
from ..config import mode_of
from .manager import GraphPass, sort_and_clean

log = logging.getLogger(__name__)

__all__ = [
    "PatternFusion",
    "PatternSet",
    "Replacement",
    "decomp_kind",
    "register_replacement",
]

def decomp_kind(config: Any) -> str:
    """Which decomposition table made this config's graphs."""

    return "inductor" if mode_of(config) == "max-autotune" else "aten"


def _decomp_fn(kind: str) -> Callable[[], dict[Any, Any]]:
    if kind == "inductor":
        return inductor_decomp_table
    return dict


@dataclasses.dataclass
class Replacement:
    """One search/replace pair; ``training`` traces forward and backward together
    (for joint graphs), else the forward alone."""

    name: str
    search_fn: Callable[..., Any]
    replace_fn: Callable[..., Any]
    example_inputs: Callable[[], Sequence[Any]] | Sequence[Any]
    extra_check: Callable[[Any], bool] | None = None
    scalar_workaround: dict[str, float | int] | None = None
    training: bool = False

    def inputs(self) -> list[Any]:
        ex = self.example_inputs() if callable(self.example_inputs) else self.example_inputs
        return list(ex)


class PatternSet:
    """Named groups of replacements, traced per decomposition kind on first use.

    ``apply(gm, kind)`` runs each group in order and returns ``{group: matches}``.
    """

    def __init__(self) -> None:
        self._groups: dict[str, list[Replacement]] = {}
        self._traced: dict[tuple[str, str], Any] = {}  # (group, kind) -> PatternMatcherPass
        self._lock = threading.Lock()

    def add(self, group: str, replacement: Replacement) -> None:
        with self._lock:
            self._groups.setdefault(group, []).append(replacement)
            for key in [k for k in self._traced if k[0] == group]:
                del self._traced[key]

    def groups(self) -> list[str]:
        return list(self._groups)

    def __len__(self) -> int:
        return sum(len(v) for v in self._groups.values())

    def _matcher(self, group: str, kind: str) -> Any:
        key = (group, kind)
        with self._lock:
            if key not in self._traced:
                self._traced[key] = _trace_group(group, self._groups.get(group, []), kind)
            return self._traced[key]

    def apply(self, gm: fx.GraphModule, kind: str, groups: Sequence[str] | None = None) -> dict[str, int]:
        counts: dict[str, int] = {}
        # replacements are traced in the graph's fake mode, so new nodes get fake values
        fake_mode = fake_mode_of(n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder"))
        with inductor_virtual_fake_mode(fake_mode):
            for group in groups if groups is not None else self.groups():
                matcher = self._matcher(group, kind)
                counts[group] = int(matcher.apply(gm.graph)) if matcher is not None else 0
        # the matcher caches mutation regions on the nodes; later passes (in-place
        # recovery) add mutations, and Inductor's own matcher would trust stale regions
        for n in gm.graph.nodes:
            n.meta.pop("mutation_region_id", None)
        return counts


def _trace_group(group: str, replacements: list[Replacement], kind: str) -> Any:
    if not replacements:
        return None
    matcher = pattern_matcher_pass(f"graphgear_{group}")
    get_decomp = _decomp_fn(kind)
    for r in replacements:
        kwargs: dict[str, Any] = {}
        if r.extra_check is not None:
            kwargs["extra_check"] = r.extra_check
        if r.scalar_workaround:
            kwargs["scalar_workaround"] = dict(r.scalar_workaround)
        try:
            # traced with real example tensors, outside any fake mode the compile runs in
            with unset_fake_temporarily(), tracing(None):
                register_pattern(
                    r.search_fn,
                    r.replace_fn,
                    r.inputs(),
                    matcher,
                    training=r.training,
                    get_decomp_fn=get_decomp,
                    **kwargs,
                )
        except Exception as e:  # a pattern that cannot be traced must not break compiles
            log.warning("graphgear: pattern %s (%s graphs) could not be traced and is skipped: %s",
                        r.name, kind, e)
    return matcher


# user patterns: run by the post-grad pattern_fusion pass
_USER = PatternSet()


def register_replacement(
    search_fn: Callable[..., Any],
    replace_fn: Callable[..., Any],
    example_inputs: Sequence[Any] | Callable[[], Sequence[Any]],
    *,
    extra_check: Callable[[Any], bool] | None = None,
    scalar_workaround: dict[str, float | int] | None = None,
    name: str | None = None,
) -> None:
    """Rewrite every match of ``search_fn`` into ``replace_fn`` in graphgear's graphs.

    ``search_fn`` and ``replace_fn`` take the same tensors (and scalars) and return the
    same results; ``example_inputs`` (or a function that makes them) are tensors of the
    right ranks and dtypes that both are traced with. Scalars in the pattern match any
    value unless named in ``scalar_workaround`` (``{"eps": 1e-6}``: the pattern's
    ``eps`` argument binds whatever the graph has and is passed to ``replace_fn``).
    ``extra_check(match) -> bool`` can refuse a match. Replacements run in the post-grad
    ``pattern_fusion`` pass of every mode, in registration order, on forward, backward
    and inference graphs; ``experimental_config.pattern_fusion_pass=False`` turns them off.
    """
    if not callable(search_fn) or not callable(replace_fn):
        raise TypeError(
            "graphgear.register_replacement: search_fn and replace_fn must be callables, got "
            f"{type(search_fn).__name__} and {type(replace_fn).__name__}."
        )
    if not callable(example_inputs):
        if not isinstance(example_inputs, list | tuple) or not example_inputs:
            raise TypeError(
                "graphgear.register_replacement: example_inputs must be a non-empty list or "
                f"tuple of example arguments (or a function returning one), got {example_inputs!r}."
            )
        try:
            n = len(_signature_params(search_fn))
        except (TypeError, ValueError):
            n = None
        if n is not None and n != len(example_inputs):
            raise ValueError(
                f"graphgear.register_replacement: search_fn takes {n} arguments but "
                f"{len(example_inputs)} example inputs were given; give one per argument."
            )
    rname = name or getattr(search_fn, "__name__", "pattern")
    _USER.add("user", Replacement(rname, search_fn, replace_fn, example_inputs,
                                  extra_check=extra_check, scalar_workaround=scalar_workaround))
    log.debug("graphgear: registered replacement %s", rname)


def _signature_params(fn: Callable[..., Any]) -> list[str]:
    return list(inspect.signature(fn).parameters)


def clear_replacements() -> None:
    """Forget every user replacement (tests)."""
    global _USER
    _USER = PatternSet()


class PatternFusion(GraphPass):
    """Post-grad pass: the user's registered replacements."""

    name = "pattern_fusion"

    def enabled(self, config: Any) -> bool:
        return bool(config.experimental_config.pattern_fusion_pass) and len(_USER) > 0

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
        counts = _USER.apply(gm, decomp_kind(config))
        n = sum(counts.values())
        if n:
            sort_and_clean(gm)
        return n

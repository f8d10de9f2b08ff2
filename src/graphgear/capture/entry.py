"""One capture of a capture engine (:class:`Entry`) and the small helpers the engine's
hot path uses on the inputs of a call."""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch

from .._torch.storage import StorageWeakRef, has_internal_overlap

__all__ = ["DATA_PTR", "Entry", "InputRoles", "getter", "same_memory", "static_buffer"]


@dataclasses.dataclass
class Entry:
    """One capture: a graph key in one thread (and, where addresses are baked in, one
    set of addresses of the inputs bound in place)."""

    warm: int = 0
    graph: Any = None
    uncaptured: bool = False
    copy_idx: list[int] = dataclasses.field(default_factory=list)
    # the outputs in the graph's memory (handed out through aliases), and each one's
    # last hand-out (pool.hand_out gives its alias out again when unused)
    alias_idx: list[int] = dataclasses.field(default_factory=list)
    handouts: list[Any] = dataclasses.field(default_factory=list)
    bound_refs: list[StorageWeakRef] = dataclasses.field(default_factory=list)
    recapture: bool = False  # a key seen before with inputs used in place elsewhere
    # frozen_parameter: the static inputs the key names by identity, held so that their
    # ids stay theirs while the capture lives
    statics: tuple[Any, ...] = ()
    # code holding the static inputs' values: the parameters among ``statics`` and
    # their version counters when it was captured
    params: tuple[Any, ...] = ()
    versions: tuple[int, ...] = ()
    # the pool it captures into: the engine's, or lane ``lane`` of it (a second instance
    # of the key, for a call in the same step while the first one's outputs are alive)
    pool: Any = None
    lane: int = 0


DATA_PTR = torch.Tensor.data_ptr  # (a method descriptor: map calls it without a Python frame)


def same_memory(a: torch.Tensor, bound: torch.Tensor) -> bool:
    """Whether ``a`` starts where the bound input ``bound`` does. A bound input that was
    an output of a graph of this pool (a KV cache a graph made, then fed in to be updated
    in place) is poisoned when that graph replays: it is not the caller's any more, and
    the call's tensor is bound instead, wherever it lies."""
    where = a.data_ptr()  # (a stale output passed in raises here, as it should)
    try:
        return where == bound.data_ptr()
    except RuntimeError:
        return False


def getter(idx: Sequence[int]) -> Any:
    """``args -> tuple(args[i] for i in idx)``, in C."""
    if not idx:
        return lambda args: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*idx)


def static_buffer(a: torch.Tensor) -> torch.Tensor:
    """A buffer a capture copies input ``a`` into: ``a``'s layout, or dense where ``a``
    is expanded or overlaps itself."""
    if not has_internal_overlap(a):
        return torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
    return torch.empty(a.size(), dtype=a.dtype, device=a.device)


@dataclasses.dataclass(frozen=True)
class InputRoles:
    """What a capture does with each input of a static graph: ``static`` inputs
    (parameters, buffers, ``mark_static_address``) are bound and never copied, ``mutated``
    ones (KV caches) are used in place, ``others`` are copied into static buffers
    (``copied``, with ``clone_input``) or, without it, used in place too; ``scalars``
    are the inputs that are not tensors."""

    static: list[int]
    mutated: list[int]
    others: list[int]
    scalars: list[int]
    copied: list[int]

    @classmethod
    def of(cls, example_inputs: Sequence[Any], *, stage: str, static_inputs: Sequence[int],
           mutated_inputs: Sequence[int], clone_input: bool) -> InputRoles:
        n = len(example_inputs)
        tensors = [i for i, a in enumerate(example_inputs) if isinstance(a, torch.Tensor)]
        # AOT's static indices describe forward/inference inputs; a backward graph's
        # inputs are saved activations and gradients: all of them are copied.
        static = set() if stage == "backward" else {i for i in static_inputs if i < n}
        mutated = {i for i in mutated_inputs if i < n}
        others = [i for i in tensors if i not in static and i not in mutated]
        return cls(static=sorted(i for i in tensors if i in static and i not in mutated),
                   mutated=sorted(i for i in tensors if i in mutated), others=others,
                   scalars=[i for i in range(n) if i not in tensors],
                   copied=others if clone_input else [])

    def as_bound(self, example_inputs: Sequence[Any]) -> list[Any]:
        """``example_inputs`` laid out as a capture binds them: a copied input that is
        expanded or overlaps itself becomes dense (:func:`static_buffer`), so code
        compiled for these runs on the capture's buffers."""
        out = list(example_inputs)
        for i in self.copied:
            if has_internal_overlap(out[i]):
                out[i] = out[i].new_empty(out[i].size())
        return out

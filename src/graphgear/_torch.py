"""Every private torch API graphgear relies on, in one place, with its version notes.

Each function here wraps one private (underscore) torch entry point and says which torch
versions have it and what graphgear does where it is missing. Other modules import these
wrappers instead of reaching into ``torch._C`` themselves, so a torch upgrade that moves
something breaks here, visibly, and nowhere else.

Tested on torch 2.13.0 (CPU build, CI) and 2.11.0 (CUDA 13 build, on a lent H200).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "StorageWeakRef",
    "fake_mode_of",
    "has_internal_overlap",
    "non_owning_storage",
    "stable_topological_sort",
    "storage_poisoner_builtin",
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
            torch.UntypedStorage._free_weak_ref(cdata)


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
    from torch._guards import detect_fake_mode

    return detect_fake_mode(list(values))

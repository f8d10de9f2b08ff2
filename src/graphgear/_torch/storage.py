"""Storage internals: non-owning storages, weak references to a ``StorageImpl``, use
counts, version counters and torch's own storage poison (``torch._C._*`` and private
``UntypedStorage`` / ``Tensor`` methods).

Checked on 2.13 (CPU build) and 2.14.1; cudagraph trees and
``torch.multiprocessing.reductions`` use the same methods in 2.11 to 2.14. If they moved,
the capture layer (``capture/liveness``, ``capture/engine``) could not alias its pooled
outputs, tell dead outputs from live ones or poison stale ones, and the no-op removal
pass could not group nodes by memory; each wrapper's note says which.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "StorageWeakRef",
    "has_internal_overlap",
    "has_storage",
    "non_owning_storage",
    "storage_id",
    "storage_poisoner_builtin",
    "storage_use_count",
    "tensor_use_count",
    "tensor_version",
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

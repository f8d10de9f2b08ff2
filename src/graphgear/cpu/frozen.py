"""The copies made of frozen weights (packed, concatenated), shared by a graph's gears.

With ``frozen_parameter`` every gear's static compile turns the weights into constants
and makes copies of them: the concatenation of the products that share their rows
(:func:`~.passes.pack_frozen.group_frozen_products`) and the packed layout of each product
(:func:`~.passes.pack_frozen.pack_frozen_small`, :func:`~.passes.pack_frozen.pack_frozen_linears`). A
copy depends on the weights only (MKL's packing also on the row count), so the gears
and graphs of one model can hold the same one: :class:`FrozenCopies` (each
``GraphgearBackend`` holds one and hands it to every graph it compiles, through the
compile context; a graph compiled without a backend gets its own) gives a gear the copy
an earlier gear made instead of making another.

A weight is known by its memory (storage address, offset, shape, strides, dtype) and
its version counter (a weight loaded in place since is another weight), a
copy the store made by how it was made (so a packed concatenation is found again
although each gear concatenates anew). The store holds copies weakly: a copy lives as
long as some gear's compiled code holds it (a concatenation only packed, not read, dies
with its gear's compile). While a copy lives the store holds the weights it was made
from, so their memory is not reused by another tensor meanwhile. Frozen weights are
read when a gear first copies them: an update in place is not seen, as
``frozen_parameter`` promises.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["FrozenCopies", "copy_of"]


def _where(t: torch.Tensor) -> tuple[Any, ...]:
    # with its version: weights loaded in place since (``load_state_dict``) are new weights
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
            t._version)


class FrozenCopies:
    """Copies of frozen weights made once per store: ``get(kind, sources, make)``."""

    def __init__(self) -> None:
        # key -> (the copy, weakly; the sources known by address, held)
        self._made: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], tuple[torch.Tensor, ...]]] = {}
        self._made_from: dict[int, tuple[Any, ...]] = {}  # id(copy) -> its key
        self._lock = threading.Lock()

    def _ident(self, t: torch.Tensor) -> tuple[Any, ...]:
        key = self._made_from.get(id(t))
        return ("made", key) if key is not None else _where(t)

    def _forget(self, key: tuple[Any, ...], ident: int) -> Callable[[Any], None]:
        def dead(ref: Any) -> None:
            with self._lock:
                if key in self._made and self._made[key][0] is ref:
                    del self._made[key]
                if self._made_from.get(ident) == key:
                    del self._made_from[ident]
        return dead

    def get(self, kind: str, sources: Sequence[torch.Tensor], make: Callable[[], torch.Tensor],
            *, extra: tuple[Any, ...] = ()) -> torch.Tensor:
        """The copy ``kind`` (with ``extra``, e.g. a row count) of ``sources``: made by
        ``make()`` unless a copy made so is alive."""
        with self._lock:
            idents = tuple(self._ident(t) for t in sources)
            key = (kind, extra, idents)
            hit = self._made.get(key)
            value = hit[0]() if hit is not None else None
        if value is not None:
            return value
        with torch.no_grad():
            value = make()
        held = tuple(t for t, i in zip(sources, idents) if i[0] != "made")
        with self._lock:
            hit = self._made.get(key)
            old = hit[0]() if hit is not None else None
            if old is not None:
                return old
            self._made[key] = (weakref.ref(value, self._forget(key, id(value))), held)
            self._made_from[id(value)] = key
        return value

    def __copy__(self) -> FrozenCopies:
        return FrozenCopies()

    def __deepcopy__(self, memo: dict[int, Any]) -> FrozenCopies:
        # a copied backend (transformers deep-copies its CompileConfig, backend included,
        # before torch.compile) starts a store of its own: the copies are a cache
        return FrozenCopies()

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for ref, _ in self._made.values() if ref() is not None)

    def nbytes(self) -> int:
        """Bytes held in live copies (an MKL-packed weight, an opaque tensor with no
        storage to ask: the size MKL asked for)."""
        with self._lock:
            alive = [ref() for ref, _ in self._made.values()]
        return sum(v.numel() * v.element_size() if v.is_mkldnn else v.untyped_storage().nbytes()
                   for v in alive if v is not None)


def copy_of(copies: FrozenCopies | None, kind: str, sources: Sequence[torch.Tensor],
            make: Callable[[], torch.Tensor], *, extra: tuple[Any, ...] = ()) -> torch.Tensor:
    """``copies.get(...)``, or ``make()`` where there is no store (a graph compiled on
    its own)."""
    if copies is None:
        with torch.no_grad():
            return make()
    return copies.get(kind, sources, make, extra=extra)

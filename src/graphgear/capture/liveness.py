"""Output liveness: make a tensor whose memory a later replay overwrote raise on access.

A device graph's outputs live in the graph's memory; the next replay writes new values
there. graphgear hands out each static output through a fresh, non-owning storage that
aliases the graph's memory, and when a later replay is about to overwrite that memory it
*poisons* the handed-out storage: any read of the tensor (or of a view of it) then
raises ``RuntimeError`` with graphgear's message. The graph's own buffers are never
poisoned.

Poisoning uses ``c10::StorageImpl::release_data_and_set_meta_custom_data_ptr_error_msg_``
(the mechanism cudagraph trees use on CUDA). Python exposes it only on CUDA builds
(``torch._C._set_storage_access_error_msg``), so on other builds graphgear compiles a
three-line extension once (cached on disk by ``torch.utils.cpp_extension``). If neither
is available the tensor is pointed at an unallocated storage, which raises ATen's own
"data is not allocated" error: still an error, never stale or new values.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = ["alias", "poison"]

_SRC = r"""
#include <torch/extension.h>
void poison(const at::Tensor& t, const std::string& msg) {
  t.storage().unsafeGetStorageImpl()->release_data_and_set_meta_custom_data_ptr_error_msg_(msg);
}
"""

_lock = threading.Lock()
_impl: Callable[[torch.Tensor, str], None] | None = None


def _null_storage(t: torch.Tensor, msg: str) -> None:
    st = torch._C._construct_storage_from_data_pointer(0, t.device, t.untyped_storage().nbytes())
    t.set_(st, t.storage_offset(), t.size(), t.stride())


def _load() -> Callable[[torch.Tensor, str], None]:
    global _impl
    with _lock:
        if _impl is not None:
            return _impl
        fn = getattr(torch._C, "_set_storage_access_error_msg", None)
        if fn is not None:
            _impl = fn
            return fn
        try:
            from torch.utils.cpp_extension import load_inline

            mod = load_inline(
                "graphgear_liveness", cpp_sources=[_SRC], functions=["poison"],
                extra_cflags=["-O1"], verbose=False,
            )
            _impl = mod.poison
        except Exception as e:  # no compiler: degrade to ATen's "not allocated" error
            log.warning(
                "graphgear: could not build the output-liveness extension (%s); overwritten "
                "outputs of reduce-overhead graphs will raise ATen's 'data is not allocated' "
                "error instead of graphgear's message.", e,
            )
            _impl = _null_storage
        return _impl


def poison(t: torch.Tensor, msg: str) -> None:
    """Make every later access to ``t``'s storage raise ``RuntimeError(msg)``."""
    _load()(t, msg)


def alias(static: torch.Tensor) -> torch.Tensor:
    """A tensor over ``static``'s memory with a storage of its own (not owning the
    memory), so it can be poisoned without touching ``static``."""
    st = static.untyped_storage()
    own = torch._C._construct_storage_from_data_pointer(st.data_ptr(), static.device, st.nbytes())
    out = torch.empty((), dtype=static.dtype, device=static.device)
    out.set_(own, static.storage_offset(), static.size(), static.stride())
    return out


def warm() -> None:
    """Build or load the extension now (tests and capture call it before timing)."""
    _load()


def _is_poisoned(t: Any) -> bool:
    try:
        t.data_ptr()
    except RuntimeError:
        return True
    return False

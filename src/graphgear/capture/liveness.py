"""Output liveness: a captured graph's outputs raise once a later replay overwrote them.

A device graph's outputs live in the graph's memory; the next replay writes new values
there. graphgear hands out each static output through an *alias*: a tensor over the same
memory with a ``StorageImpl`` of its own that does not own the memory. The pool keeps a
weak reference to that storage (not to the tensor: a view made under
``torch.inference_mode()`` keeps the storage alive but not the tensor it came from), and
before a replay overwrites the memory it *poisons* every alias storage still alive:
every read through any tensor or view over it then raises ``RuntimeError`` with
graphgear's message. The graph's own buffers are never poisoned.

Poisoning is ``c10::StorageImpl::release_data_and_set_meta_custom_data_ptr_error_msg_``:

* CUDA builds of torch expose it (``_torch.storage.storage_poisoner_builtin``);
* CPU builds do not, so graphgear builds a three-line extension once, in a subprocess
  with a time limit, into a per-user folder (``~/.cache/graphgear/extensions``, mode
  0700); a stale build lock or a failing build never hangs or crashes the caller;
* where neither is available :func:`poisoner` returns None and the capture engine
  clones every output instead (``clone_output=True``), with one warning: slower, never
  wrong.

**Handing an output out again.** Most callers drop an output before the next step (a
decode loop keeps the token it sampled, not the logits). The graph then keeps the alias
it handed out (:attr:`Handout.held`) and, when the next replay comes, checks that
nothing but graphgear still reaches it: no Python reference (``sys.getrefcount``), no C++
owner of its ``TensorImpl`` (a view's base, an autograd node's saved tensor), no other
user of its storage (a view, a NumPy array), no reference to its Python storage object
(``untyped_storage()`` hands out the one torch keeps with the storage), no weak reference,
and its metadata as handed out (no ``requires_grad_()``, ``.grad``, attribute or in-place
view op since). Such an alias is not poisoned but handed out again by the next replay of
its graph, as cudagraph trees do: no new ``StorageImpl`` or ``TensorImpl`` per replay.
Any alias that fails a check is poisoned as above, and the next replay makes a new one.

Memory stays valid while anything can reach it: a poisoned alias no longer reaches it
through torch, but a NumPy array (or a raw ``data_ptr()``) taken earlier still points
into it. :class:`Keeper` therefore holds the memory's owner (the pool block or static
buffer) until the alias storage itself is gone; ``reset()`` and pool growth free only
memory no alias can reach. Such an array shows whatever the graph last wrote there.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._torch.storage import (
    StorageWeakRef,
    non_owning_storage,
    storage_id,
    storage_poisoner_builtin,
    storage_use_count,
    tensor_use_count,
)
from ..cache.store import default_cache_root, make_private_dirs, tighten_own_folder, unsafe_reason

log = logging.getLogger(__name__)

__all__ = ["Handout", "Keeper", "alias", "build_extension", "poisoner"]

_SRC = r"""
#include <torch/extension.h>
// Same effect as torch._C._set_storage_data_ptr_access_error_msg (CUDA builds only):
// every later data access through this StorageImpl raises RuntimeError(msg).
void poison(int64_t storage_impl, const std::string& msg) {
  reinterpret_cast<c10::StorageImpl*>(storage_impl)
      ->release_data_and_set_meta_custom_data_ptr_error_msg_(msg);
}
"""

#: Seconds a build of the extension may take (a cold build takes about 30 s on 2 cores).
BUILD_TIMEOUT_ENV = "GRAPHGEAR_BUILD_TIMEOUT"
DEFAULT_BUILD_TIMEOUT = 300.0


def extension_dir() -> Path:
    """Where the liveness extension is built: per user, per torch and Python version."""
    base = os.environ.get("GRAPHGEAR_EXTENSIONS_DIR")
    root = Path(base) if base else Path(default_cache_root()) / "graphgear" / "extensions"
    tag = hashlib.sha256(f"{_SRC}{torch.__version__}{sys.version}".encode()).hexdigest()[:12]
    return root / f"liveness-{tag}"


def _module_name(folder: Path) -> str:
    return "graphgear_" + folder.name.replace("-", "_")


def _load_built(folder: Path) -> Any | None:
    name = _module_name(folder)
    for f in folder.glob(f"{name}*.so"):
        spec = importlib.util.spec_from_file_location(
            name, f, loader=importlib.machinery.ExtensionFileLoader(name, str(f)))
        if spec is None or spec.loader is None:
            continue
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return None


def build_extension(folder: Path | None = None, timeout: float | None = None) -> Any | None:
    """Build (once) and load the poison extension; None with a warning when it cannot be.

    The build runs in a subprocess with ``timeout`` seconds (default
    ``$GRAPHGEAR_BUILD_TIMEOUT`` or 300): torch's builder waits forever on a ``lock`` file
    that a build killed half-way leaves behind, and the caller must not hang with it.
    """
    folder = folder or extension_dir()
    if timeout is None:
        timeout = float(os.environ.get(BUILD_TIMEOUT_ENV, DEFAULT_BUILD_TIMEOUT))
    try:
        if folder.is_dir() and unsafe_reason(str(folder)) is None:
            mod = _load_built(folder)
            if mod is not None:
                return mod
        make_private_dirs(str(folder))
        for f in (folder.parent, folder):  # it will hold a library this process loads
            tighten_own_folder(str(f))
            reason = unsafe_reason(str(f))
            if reason is not None:
                raise PermissionError(f"{f}: {reason}")
        script = (
            "import sys, torch.utils.cpp_extension as c\n"
            "c.load_inline(sys.argv[1], cpp_sources=[sys.argv[2]], functions=['poison'], "
            "build_directory=sys.argv[3], extra_cflags=['-O1'], verbose=False)\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", script, _module_name(folder), _SRC, str(folder)],
            capture_output=True, text=True, timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip()
                               else f"exit status {proc.returncode}")
        mod = _load_built(folder)
        if mod is None:
            raise RuntimeError(f"the build left no module in {folder}")
        return mod
    except subprocess.TimeoutExpired:
        lock = folder / "lock"
        why = (f"a stale build lock {lock} (left by a process killed while building) blocks it"
               if lock.exists() else "the build did not finish")
        log.warning(
            "graphgear: building the output-liveness extension took over %.0f s: %s. Delete the "
            "folder %s and try again (or raise $%s). Until then reduce-overhead clones its "
            "outputs.", timeout, why, folder, BUILD_TIMEOUT_ENV)
    except Exception as e:  # no compiler, unwritable folder, ...
        log.warning(
            "graphgear: could not build the output-liveness extension in %s (%s: %s); "
            "reduce-overhead clones its outputs instead (correct, slower). Install a C++ "
            "compiler, or point $GRAPHGEAR_EXTENSIONS_DIR at a writable folder of your own.",
            folder, type(e).__name__, e)
    return None


_RESOLVE_LOCK = threading.Lock()


@functools.cache
def _resolve() -> Callable[[int, str], None] | None:
    fn = storage_poisoner_builtin()
    if fn is not None:
        return fn
    mod = build_extension()
    return None if mod is None else mod.poison


def poisoner() -> Callable[[int, str], None] | None:
    """``poison(storage_impl_address, msg)``, or None when this process has none (the
    engine then clones outputs). Resolved (built) once per process."""
    with _RESOLVE_LOCK:
        return _resolve()


def alias(static: torch.Tensor) -> torch.Tensor:
    """A tensor over ``static``'s memory with a storage of its own that does not own the
    memory, so it can be poisoned without touching ``static``."""
    st = static.untyped_storage()
    own = non_owning_storage(st.data_ptr(), static.device, st.nbytes())
    # Tensor.new(): an empty tensor of static's dtype and device (the cheapest way to a
    # fresh TensorImpl: a third of torch.empty's cost on the replay path)
    return static.new().set_(own, static.storage_offset(), static.size(), static.stride())


class Handout:
    """One output handed out: a weak reference to its alias storage and a strong one to
    the memory's owner (kept until the alias storage is gone).

    ``held`` keeps the alias tensor itself, so that the next replay can hand it out
    again when nothing else reaches it (:meth:`unused`); ``free`` says the last
    invalidation found it so. Poisoning or a release lets go of it (``held`` None)."""

    __slots__ = ("free", "held", "owner", "ptr", "ref", "shape", "storage_refs", "strides", "start",
                 "uses")

    def __init__(self, alias_tensor: torch.Tensor, owner: torch.UntypedStorage) -> None:
        st = alias_tensor.untyped_storage()
        self.ref = StorageWeakRef(st)
        self.ptr = st.data_ptr()
        self.owner = owner
        del st
        self.held: torch.Tensor | None = alias_tensor
        self.free = False
        # where, and as what, the alias was handed out
        self.start = alias_tensor.data_ptr()
        self.shape = alias_tensor.size()
        self.strides = alias_tensor.stride()
        # the storage's users as handed out: the alias's TensorImpl (and the Python
        # storage object torch keeps with it once one was made), and the references to
        # that Python object (a caller's ``untyped_storage()`` is the same object: it
        # adds a reference to it, not a user of the storage)
        self.uses = storage_use_count(self.ref.cdata)
        self.storage_refs = _storage_refs(alias_tensor)

    def unused(self) -> bool:
        """Whether nothing but this hand-out reaches the held alias (see the module
        docstring); False when none is held."""
        if self.held is None or _held_refs(self) != _ONLY_HELD:  # (no local name for it yet)
            return False
        t = self.held
        return (tensor_use_count(t) == 1
                and storage_use_count(self.ref.cdata) == self.uses
                and _storage_refs(t) == self.storage_refs
                and not weakref.getweakrefcount(t) and not t.requires_grad
                and t.grad is None and not t.__dict__)

    def alive(self) -> bool:
        """Whether the caller may still read the output (a held alias nothing else
        reaches is not)."""
        if self.held is not None:
            return not self.unused()
        return not self.ref.expired()

    def matches(self, static: torch.Tensor) -> bool:
        """Whether the held alias can stand for ``static`` (its graph's output, of the
        size and strides of every replay): ``static`` is where it was (a pool block
        that grew moves it), and the alias is as handed out (an in-place view op or
        ``set_`` since makes it differ)."""
        t = self.held
        return (t is not None and static.data_ptr() == self.start and t.data_ptr() == self.start
                and t.size() == self.shape and t.stride() == self.strides)


def _held_refs(h: Any) -> int:
    """``sys.getrefcount`` of ``h.held`` as seen from here: what it counts besides the
    holders (the local name, the call's argument) depends on the Python version (3.14
    borrows references it loads), so it is compared with :data:`_ONLY_HELD`, measured
    the same way on an object only its holder reaches."""
    t = h.held
    return sys.getrefcount(t)


def _storage_refs(t: torch.Tensor) -> int:
    """``sys.getrefcount`` of ``t``'s Python storage object, as seen from here."""
    st = t.untyped_storage()
    return sys.getrefcount(st)


class _Holder:
    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = object()


#: :func:`_held_refs` of an object nothing but its holder reaches (3 on CPython 3.10-3.13)
_ONLY_HELD = _held_refs(_Holder())


class Keeper:
    """Owners of memory that poisoned aliases may still reach through raw pointers
    (NumPy arrays); each is dropped once its alias storage is gone.

    One per process (:data:`KEEPER`): the memory can outlive the graph, pool and thread
    that made it, so it cannot belong to any of them. While an arena lives it keeps its
    own poisoned hand-outs (no lock per replay); it hands them here when it is released
    or collected."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[Handout] = []

    def hold(self, items: list[Handout]) -> None:
        with self._lock:
            self._held = [h for h in self._held if not h.ref.expired()] + items

    def sweep(self) -> None:
        if self._held:
            with self._lock:
                self._held = [h for h in self._held if not h.ref.expired()]

    def __len__(self) -> int:
        return len(self._held)


KEEPER = Keeper()


def recycle_unused(handed: list[Handout]) -> list[Handout]:
    """Mark ``free`` every hand-out whose held alias nothing else reaches (its graph
    hands it out again, unpoisoned); returns the others, which need poisoning."""
    rest = []
    for h in handed:
        if h.unused():
            h.free = True
        else:
            rest.append(h)
    return rest


def poison_all(handed: list[Handout], msg: str, poison: Callable[[int, str], None],
               kept: list[Handout]) -> int:
    """Poison every alias in ``handed`` that is still alive and append it to ``kept``
    (whose owner keeps the memory until the alias is gone; see :class:`Keeper`); each
    hand-out lets go of its held alias first. Returns how many were poisoned."""
    n = 0
    for h in handed:
        h.held = None
        st = h.ref()  # a strong reference while poisoning (another thread may drop it)
        if st is None:
            continue
        poison(storage_id(st), msg)
        kept.append(h)
        n += 1
    return n

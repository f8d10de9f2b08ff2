"""A compile cache entry file: its format, its writing, and its trusted reading.

**Format.** ``MAGIC``, one JSON header line (key parts, payload sha256, size) and the
payload (torch's ``save_compiled_function`` bytes, see :mod:`graphgear.cache`). Files
are named ``<function>-<key prefix>.ggc`` (``SUFFIX``).

**Trust.** Before anything is unpickled, the loader refuses, with a warning naming the
file and the reason, and then recompiles: a cache folder not owned by the user or
writable by group/others (a symlinked folder is judged by what it resolves to); a symlink
inside it (entry or sub-folder); an entry file not owned by the user or with a mode other
than 0600 (all :func:`graphgear.cache.store.unsafe_reason`); a payload whose sha256
differs from the header's; a header whose key parts (torch/graphgear versions, code
hash, ...) differ from this process's.

**Who unpickles what**, after those checks:

* torch's ``load_compiled_function`` unpickles its own payload (dynamo's bytecode, code
  objects and guards: it builds code objects by design, so the checks above are what
  make it safe), and hands graphgear its part as bytes;
* graphgear's part (AOTAutograd's entry, the stores, Inductor's compiled graphs) goes
  through :class:`_RestrictedUnpickler`, and the graph inside a store through
  ``GraphPickler``'s unpickler, both limited to the globals
  :func:`graphgear.cache.artifacts.allowed_global` lists (TorchAir's
  ``_StrictModelUnpickler`` idea): AOTAutograd's and Inductor's record types, sympy size
  classes, plain containers; no ``eval``, ``getattr``, ``os``, ``sympify``;
* Inductor's generated module (the text in the checksummed entry) is written to
  Inductor's code cache and imported; a file already there with different text is
  overwritten with the verified text first (``_torch.serialize.inductor_output_load``). Its C++
  kernels come from Inductor's private on-disk cache, trusted as ``torch.compile``
  trusts it.

**Writes** happen only after a compile, under an exclusive ``fcntl.flock`` on
``<folder>/.lock``, to a private temporary file that ``os.replace`` renames: a reader
never sees a half-written entry, and two writers both succeed (the last rename wins).
The temporary file's name carries the writer's pid (``.tmp-<pid>-...``); a writer killed
mid-write (SIGKILL, SIGTERM) leaves it behind, so each write first removes the temporary
files of the folder older than :data:`STALE_TMP_SECONDS` whose writer is not alive (or
whose name carries no pid: an older graphgear's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import re
import tempfile
import time
from typing import Any

from .._torch.isa import inductor_vec_isa_if_known
from .artifacts import SUBSTITUTES, allowed_global
from .store import cache_folder, locked, stat_unsafe_reason, unsafe_reason

log = logging.getLogger(__name__)

__all__ = ["MAGIC", "STALE_TMP_SECONDS", "SUFFIX", "CacheEntry", "clear_entries", "list_entries"]

MAGIC = b"GRAPHGEAR-CACHE-1\n"
SUFFIX = ".ggc"
#: a temporary file of a writer that is not alive, older than this, is removed by the next write
STALE_TMP_SECONDS = 300.0
_TMP_PID = re.compile(r"\.tmp-(\d+)-")


@dataclasses.dataclass
class CacheEntry:
    """One entry file, as ``graphgear cache ls`` shows it."""

    path: str
    name: str
    key: str
    parts: dict[str, str]
    size: int
    age_seconds: float


def _write_entry(path: str, name: str, key: str, parts: dict[str, str], payload: bytes,
                 extra: dict[str, Any] | None = None) -> None:
    # "vec_isa": the CPU vector ISA Inductor probed for here (not a key part: a later
    # process on a CPU whose flags lead to the same ISA skips Inductor's base probes);
    # ``extra``: more header fields ("globals": the named identities of the entry's globals)
    header = {**(extra or {}), "name": name, "key": key, "parts": parts,
              "sha256": hashlib.sha256(payload).hexdigest(), "size": len(payload),
              "created": time.time(), "vec_isa": inductor_vec_isa_if_known()}
    folder = os.path.dirname(path)
    with locked(folder):
        _remove_stale_tmp(folder)
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{os.getpid()}-", dir=folder)  # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def _remove_stale_tmp(folder: str, max_age: float = STALE_TMP_SECONDS) -> int:
    """Remove the temporary files a killed writer left in ``folder``: older than
    ``max_age`` seconds and named by a pid that is not alive (or by none). Called under the
    folder's lock, which every writer holds while its temporary file exists; the age and
    pid checks keep a file a writer outside the lock (another host) may still hold."""
    now, removed = time.time(), 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(".tmp-"):
            continue
        path = os.path.join(folder, name)
        m = _TMP_PID.match(name)
        try:
            st = os.lstat(path)
            if now - st.st_mtime < max_age or (m is not None and _alive(int(m.group(1)))):
                continue
            os.unlink(path)
        except OSError:
            continue
        removed += 1
        log.info("graphgear cache: removed %s, left by a writer that was killed", path)
    return removed


def _read_header(f: Any) -> dict[str, Any]:
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("it is not a graphgear cache entry (bad magic)")
    line = f.readline(1 << 20)
    if not line.endswith(b"\n"):
        raise ValueError("its header is truncated")
    header = json.loads(line)
    if not isinstance(header, dict) or not isinstance(header.get("parts"), dict):
        raise ValueError("its header is malformed")
    return header


def _read_trusted(path: str) -> tuple[dict[str, Any], bytes]:
    """Header and payload of ``path`` after the file checks and the checksum; raises
    ``ValueError`` with the reason to refuse it."""
    reason = unsafe_reason(path, entry_file=True)
    if reason is not None:
        raise ValueError(reason)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        # the file opened is the file checked
        if stat_unsafe_reason(os.fstat(f.fileno()), entry_file=True) is not None:
            raise ValueError("it changed owner or mode while being opened")
        header = _read_header(f)
        payload = f.read()
    if len(payload) != header.get("size") or hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise ValueError("its checksum does not match (truncated or corrupted)")
    return header, payload


def _differing(stored: dict[str, str], current: dict[str, str]) -> list[str]:
    return [k for k in current if stored.get(k) != current[k]] + [k for k in stored if k not in current]


def list_entries(cache_dir: str | None = None) -> list[CacheEntry]:
    """Every entry under the cache folder (rank sub-folders included); unreadable files
    are listed with an empty key."""
    root = cache_folder(cache_dir)
    out: list[CacheEntry] = []
    now = time.time()
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
        for fname in sorted(files):
            if not fname.endswith(SUFFIX):
                continue
            path = os.path.join(folder, fname)
            st = os.lstat(path)
            try:
                with open(path, "rb") as f:
                    header = _read_header(f)
            except (OSError, ValueError):
                header = {"name": fname, "key": "", "parts": {}}
            out.append(CacheEntry(path=path, name=str(header.get("name")), key=str(header.get("key")),
                                  parts=dict(header.get("parts") or {}), size=st.st_size,
                                  age_seconds=now - st.st_mtime))
    return out


def clear_entries(cache_dir: str | None = None) -> int:
    """Delete every entry file (and temporary file) under the cache folder; the count."""
    root = cache_folder(cache_dir)
    n = 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
        for fname in files:
            if fname.endswith(SUFFIX) or fname.startswith(".tmp-"):
                os.unlink(os.path.join(folder, fname))
                n += int(fname.endswith(SUFFIX))
    return n


class _RestrictedUnpickler(pickle.Unpickler):
    """graphgear's part of an entry: only the types :func:`allowed_global` names."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in SUBSTITUTES:
            return SUBSTITUTES[module, name]
        if not allowed_global(module, name):
            raise pickle.UnpicklingError(f"graphgear cache: global {module}.{name} is not allowed here")
        return super().find_class(module, name)

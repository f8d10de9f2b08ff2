"""The compile cache's folders, and the one check that says a path is private.

:func:`unsafe_reason` is the trust check for everything graphgear later loads code from:
a folder must be a directory owned by the current user and not writable by group or
others; an entry file (``entry_file=True``) a regular file owned by the user with mode
``0600``; neither may be a symlink (``follow_symlinks``: a folder is judged by what it
resolves to, since users link ``~/.cache`` to another disk). The cache's entry files and
folders (:func:`entry_folder`), the private Inductor cache below and the liveness
extension's build folder (``capture.liveness``) all go through it.

**The cache folder** (:func:`cache_folder`): ``cache_dir``, else ``$GRAPHGEAR_CACHE_DIR``,
else ``$XDG_CACHE_HOME/graphgear``; entries of rank ``N`` in its ``rank<N>`` sub-folder.
Writes to it take an exclusive ``fcntl.flock`` on ``<folder>/.lock`` (:func:`locked`).

**The private Inductor cache** (``TORCHINDUCTOR_CACHE_DIR``). Inductor's cache holds
generated Python wrappers and compiled libraries that a later process imports and runs,
so whoever can write to the folder can run code in every process that uses it. A fixed
folder under the shared temporary directory (the same name for every user) is therefore
unsafe: another user can create it first, or plant a file in it.
:func:`inductor_cache_dir` picks ``$XDG_CACHE_HOME/graphgear/inductor``
(``~/.cache/graphgear/inductor`` when ``XDG_CACHE_HOME`` is unset or not absolute),
creates it with mode ``0700`` and checks it (and the ``graphgear`` folder above it). A
folder that fails the check is not used; a fresh private folder (``tempfile.mkdtemp``,
mode ``0700``) replaces it, with a warning naming the folder and the reason.

:func:`use_private_inductor_cache` sets ``TORCHINDUCTOR_CACHE_DIR`` to that folder
unless the variable is already set (an explicit choice wins, if that folder is missing
or passes the same check); the test suite, the benchmarks and the scripts call it
before Inductor compiles anything.

This module imports nothing of graphgear: the lowest layers (``capture``) use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import logging
import os
import re
import stat
import tempfile
from collections.abc import Iterator

log = logging.getLogger(__name__)

__all__ = ["cache_folder", "default_cache_root", "entry_folder", "inductor_cache_dir", "locked", "make_private_dirs",
           "tighten_own_folder",
           "stat_unsafe_reason", "unsafe_reason", "use_private_inductor_cache"]

#: the compile cache's folder, when set (:func:`cache_folder`)
CACHE_ENV_VAR = "GRAPHGEAR_CACHE_DIR"
#: Inductor's on-disk cache folder (:func:`use_private_inductor_cache`)
INDUCTOR_ENV_VAR = "TORCHINDUCTOR_CACHE_DIR"


def default_cache_root() -> str:
    """``$XDG_CACHE_HOME`` if set to an absolute path, else ``~/.cache``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return xdg
    return os.path.join(os.path.expanduser("~"), ".cache")


def unsafe_reason(path: str, *, follow_symlinks: bool = False, entry_file: bool = False) -> str | None:
    """Why ``path`` is not private to the current user, or ``None`` if it is (see the
    module docstring): a folder, or with ``entry_file`` a cache entry file.
    ``follow_symlinks``: a symlinked folder is judged by what it resolves to; otherwise a
    symlink is refused."""
    try:
        st = os.stat(path) if follow_symlinks else os.lstat(path)
    except OSError as e:
        return f"cannot stat it ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink inside the cache folder" if entry_file else "it is a symlink"
    if entry_file and not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if not entry_file and not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    return stat_unsafe_reason(st, entry_file=entry_file)


def stat_unsafe_reason(st: os.stat_result, *, entry_file: bool = False) -> str | None:
    """The owner and mode part of :func:`unsafe_reason`, for a ``stat`` result already
    taken (the ``fstat`` of a file opened after the check)."""
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by the current user (uid {os.getuid()})"
    mode = stat.S_IMODE(st.st_mode)
    if entry_file and mode != 0o600:
        return f"its mode is {mode:04o}, not 0600"
    if not entry_file and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {mode:04o}; 0700 expected)"
    return None


def cache_folder(cache_dir: str | None = None) -> str:
    """The cache folder: ``cache_dir``, else ``$GRAPHGEAR_CACHE_DIR``, else
    ``~/.cache/graphgear`` (``$XDG_CACHE_HOME/graphgear``)."""
    if cache_dir:
        return cache_dir
    return os.environ.get(CACHE_ENV_VAR) or os.path.join(default_cache_root(), "graphgear")


def entry_folder(root: str, rank: int | None) -> tuple[str, str | None]:
    """``root`` (or its ``rank<N>`` sub-folder), created 0700; and why it is unsafe."""
    try:
        os.makedirs(root, 0o700, exist_ok=True)
    except OSError as e:
        return root, f"cannot create it ({e.strerror})"
    reason = unsafe_reason(root, follow_symlinks=True)
    if reason is not None or rank is None:
        return root, reason
    sub = os.path.join(root, f"rank{int(rank)}")
    if os.path.islink(sub):
        return sub, "it is a symlink inside the cache folder"
    try:
        os.mkdir(sub, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        return sub, f"cannot create it ({e.strerror})"
    return sub, unsafe_reason(sub, follow_symlinks=True)


@contextlib.contextmanager
def locked(folder: str) -> Iterator[None]:
    """An exclusive ``fcntl.flock`` on ``<folder>/.lock`` (not following a symlink)."""
    fd = os.open(os.path.join(folder, ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def make_private_dirs(path: str) -> None:
    """``os.makedirs(path)`` where every folder it creates gets mode 0700, not only the
    last (``makedirs``' ``mode`` applies to the last alone: a first build of the CPU
    graph's extension left ``~/.cache/graphgear`` open to others, and every later
    process then refused it as the Inductor cache)."""
    missing: list[str] = []
    head = os.path.abspath(path)
    while not os.path.isdir(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass


def tighten_own_folder(path: str) -> None:
    """Close a folder of graphgear's to group and others (mode 0700) where it is the
    current user's and nobody else could write into it: an earlier graphgear made its
    parent folders 0755, and refusing them for ever would leave a user with a cold
    cache and a warning in every process. A folder others could write into stays as it
    is (the trust check refuses it: its content may be theirs)."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if (stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022
            and stat.S_IMODE(st.st_mode) != 0o700):
        os.chmod(path, 0o700)
        log.info("graphgear: closed %s to group and others (mode 0700)", path)


def _make_private(path: str) -> str | None:
    """Create ``path`` (and the folders above it) with mode 0700 if missing; the reason
    it or its parent is unsafe."""
    try:
        make_private_dirs(path)
    except OSError as e:
        return f"cannot create {e.filename or path} ({e.strerror})"
    for folder in (os.path.dirname(path), path):
        tighten_own_folder(folder)
        reason = unsafe_reason(folder)
        if reason is not None:
            return f"{folder}: {reason}"
    return None


def inductor_cache_dir(root: str | None = None) -> str:
    """The per-user Inductor cache folder ``<root>/graphgear/inductor``, created private.

    ``root`` defaults to :func:`default_cache_root`. When the folder (or ``graphgear``
    above it) is not a directory owned by the current user and closed to group and
    others, a fresh private temporary folder is returned instead, with a warning.
    """
    root = root if root is not None else default_cache_root()
    path = os.path.join(root, "graphgear", "inductor")
    try:
        os.makedirs(root, 0o700, exist_ok=True)
    except OSError as e:
        reason: str | None = f"cannot create {root} ({e.strerror})"
    else:
        reason = _make_private(path)
    if reason is None:
        return path
    fresh = tempfile.mkdtemp(prefix="graphgear-inductor-")  # mode 0700, unique name
    log.warning("graphgear: not using %s as the Inductor cache: %s; using a fresh private "
                "folder %s instead", path, reason, fresh)
    return fresh


def _torch_default() -> str:
    """The folder torch writes into ``TORCHINDUCTOR_CACHE_DIR`` itself when unset
    (``torch._inductor.runtime.cache_dir_utils.default_cache_dir``): importing
    ``torch._dynamo`` sets the variable to it, so it is no explicit choice."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.abspath(os.path.join(tempfile.gettempdir(),
                                        "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)))


def use_private_inductor_cache() -> str:
    """Set ``TORCHINDUCTOR_CACHE_DIR`` to :func:`inductor_cache_dir` unless already set;
    returns the folder in effect. Call it before Inductor reads the variable."""
    current = os.environ.get(INDUCTOR_ENV_VAR)
    if current and os.path.abspath(current) == _torch_default():
        current = None  # torch put its own default there when torch._dynamo was imported
    if current:
        try:
            os.makedirs(current, 0o700, exist_ok=True)
        except OSError:
            pass  # the check below says why
        reason = unsafe_reason(current)
        if reason is None:
            return current
        path = tempfile.mkdtemp(prefix="graphgear-inductor-")
        log.warning("graphgear: not using %s=%s as the Inductor cache: %s; using a fresh private "
                    "folder %s instead", INDUCTOR_ENV_VAR, current, reason, path)
        os.environ[INDUCTOR_ENV_VAR] = path
        return path
    path = inductor_cache_dir()
    os.environ[INDUCTOR_ENV_VAR] = path
    return path

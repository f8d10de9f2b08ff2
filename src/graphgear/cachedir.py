"""A private, per-user folder for Inductor's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``).

Inductor's cache holds generated Python wrappers and compiled libraries that a later
process imports and runs, so whoever can write to the folder can run code in every
process that uses it. A fixed folder under the shared temporary directory (the same
name for every user) is therefore unsafe: another user can create it first, or plant a
file in it. :func:`inductor_cache_dir` picks ``$XDG_CACHE_HOME/graphgear/inductor``
(``~/.cache/graphgear/inductor`` when ``XDG_CACHE_HOME`` is unset or not absolute),
creates it with mode ``0700`` and checks it (and the ``graphgear`` folder above it):
owned by the current user, not a symlink, not writable by group or others. A folder
that fails the check is not used; a fresh private folder (``tempfile.mkdtemp``, mode
``0700``) replaces it, with a warning naming the folder and the reason.

:func:`use_private_inductor_cache` sets ``TORCHINDUCTOR_CACHE_DIR`` to that folder
unless the variable is already set (an explicit choice wins, if that folder is missing
or passes the same check); the test suite, the benchmarks and the scripts call it
before Inductor compiles anything.
"""

from __future__ import annotations

import getpass
import logging
import os
import re
import stat
import tempfile

log = logging.getLogger(__name__)

ENV_VAR = "TORCHINDUCTOR_CACHE_DIR"


def default_cache_root() -> str:
    """``$XDG_CACHE_HOME`` if set to an absolute path, else ``~/.cache``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg and os.path.isabs(xdg):
        return xdg
    return os.path.join(os.path.expanduser("~"), ".cache")


def unsafe_reason(path: str, *, follow_symlinks: bool = False) -> str | None:
    """Why ``path`` is not a private folder of the current user, or ``None`` if it is.
    ``follow_symlinks``: a symlinked folder is judged by what it resolves to (users link
    ``~/.cache`` to another disk); otherwise a symlink is refused."""
    try:
        st = os.stat(path) if follow_symlinks else os.lstat(path)
    except OSError as e:
        return f"cannot stat it ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by the current user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}; 0700 expected)"
    return None


def _make_private(path: str) -> str | None:
    """Create ``path`` (and its parent) with mode 0700 if missing; the reason it is unsafe."""
    parent = os.path.dirname(path)
    for folder in (parent, path):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            return f"cannot create {folder} ({e.strerror})"
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
    current = os.environ.get(ENV_VAR)
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
                    "folder %s instead", ENV_VAR, current, reason, path)
        os.environ[ENV_VAR] = path
        return path
    path = inductor_cache_dir()
    os.environ[ENV_VAR] = path
    return path

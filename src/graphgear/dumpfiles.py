"""Writing debug files safely, and naming ops: what graph dumps (:mod:`graphgear.debug`) and
data dumps (:mod:`graphgear.datadump`) share. See :mod:`graphgear.debug` for the rules a
dump file follows (never through a symlink; a failure warns and never stops the compile).
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from collections.abc import Sequence

from ._torch.ops import OpOverload, OpOverloadPacket, op_name, op_packet_name

log = logging.getLogger("graphgear.debug")

__all__ = ["make_folder", "op_key", "target_name", "text_table", "write_dump"]


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, rule: bool = True) -> str:
    """Left-aligned columns two spaces apart; ``rule`` draws dashes under the header."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    if rule:
        lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def target_name(target: object) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, OpOverload | OpOverloadPacket):
        return str(target)
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)


def op_key(target: object) -> str:
    """``aten.add`` for ``aten.add.Tensor``; the qualified name for other callables."""
    if isinstance(target, OpOverload):
        return op_name(target)
    if isinstance(target, OpOverloadPacket):
        return op_packet_name(target)
    return target_name(target)


def write_dump(path: str, text: str | bytes) -> bool:
    """Write ``text`` (or bytes) to ``path`` without following a symlink there; ``False``
    (with a warning naming the path and the reason) when it was not written.

    An existing symlink at ``path`` is refused. Otherwise the text goes to a new
    temporary file (``O_EXCL``, mode 0600) in the same folder, renamed over ``path``, so
    a link planted between the check and the rename is replaced, not followed.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("graphgear: debug dump %s not written: cannot check it (%s)", path, e.strerror)
        return False
    else:
        if stat.S_ISLNK(st.st_mode):
            log.warning("graphgear: debug dump %s not written: that name is a symlink (to %r); "
                        "graphgear does not write through links", path, _readlink(path))
            return False
        if not stat.S_ISREG(st.st_mode):
            log.warning("graphgear: debug dump %s not written: that name exists and is not a "
                        "regular file", path)
            return False
    folder, name = os.path.split(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder or ".")
        with open(fd, "wb") if isinstance(text, bytes) else open(fd, "w", newline="") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("graphgear: debug dump %s not written: %s", path, e.strerror or e)
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False
    return True


def make_folder(folder: str) -> bool:
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        log.warning("graphgear: debug dumps not written to %s: cannot create it (%s)", folder, e.strerror or e)
        return False
    return True


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"

"""Op names as ``capture_config.split_ops`` takes them, checked against the ops the
dispatcher knows (aten, prims, and every ``torch.library`` op registered so far).

:func:`split_op_problem` says what is wrong with a name, with the closest known op
(``difflib``); ``config`` raises it as a ``ConfigError`` when the option is set, and the
reduce-overhead compiler checks again when it compiles (a ``torch.library`` namespace
may be registered after the config is built).
"""

from __future__ import annotations

import difflib
from typing import Any

import torch

from ._torch.ops import all_op_names

__all__ = ["TORCH_OPS", "clean_split_ops", "split_op_problem", "split_ops_problem"]

#: the Python path of an op (``torch.ops.aten.mm``): taken as the op's name (``aten.mm``)
TORCH_OPS = "torch.ops."


def _known_ops() -> set[str]:
    """Every op the dispatcher knows now, as ``namespace.name``."""
    return {n.replace("::", ".") for n in all_op_names()}


def _spelt(name: str, key: str) -> str:
    """``key`` (``ns.op``) in ``name``'s spelling (``ns::op`` where ``name`` uses it)."""
    return key.replace(".", "::", 1) if "::" in name else key


def split_op_problem(name: str, *, unknown_namespace_ok: bool) -> str | None:
    """What is wrong with ``name`` as a ``capture_config.split_ops`` entry (None: nothing):
    an op the dispatcher does not know, with the closest one it does. A namespace no op
    is registered in yet passes where ``unknown_namespace_ok`` (a ``torch.library`` op
    may be defined after the config is built: the backend checks again when it
    compiles), unless it is ``torch`` (``torch.mm`` is a function, not an op name) or a
    near miss of a known namespace that has the op (``atne.mm``)."""
    key = name.removeprefix(TORCH_OPS).replace("::", ".")
    parts = key.split(".")
    known = _known_ops()

    def named(op: str) -> str:  # a known op of that name, aten's first
        same = sorted((k for k in known if k.split(".")[1] == op), key=lambda k: (not k.startswith("aten."), k))
        return f"; the op of that name is {_spelt(name, same[0])!r}" if same else ""

    if len(parts) < 2 or not all(parts) or (len(parts) > 3 and parts[0] != "torch"):
        return (f"{name!r} is not of the form 'namespace.op', 'namespace::op' or "
                f"'namespace.op.overload'{named(parts[-1]) if parts[-1] else ''}")
    ns, op = parts[0], parts[1]
    namespaces = {k.split(".")[0] for k in known}
    if ns == "torch":
        return (f"{name!r} is a Python name of torch, not an op: split_ops names ops as graphs hold "
                f"them ('aten.mm', 'mylib::op'){named(parts[-1])}")
    if ns == "higher_order":
        exists = hasattr(torch.ops.higher_order, op)
    elif ns not in namespaces:
        near = [c for c in difflib.get_close_matches(ns, sorted(namespaces), n=3, cutoff=0.75)
                if f"{c}.{op}" in known]
        if not near and unknown_namespace_ok:
            return None
        hint = (f"; the closest known op is {_spelt(name, f'{near[0]}.{op}')!r}" if near
                else named(op))
        return (f"{name!r} names no registered op: no op is registered in namespace {ns!r}{hint} "
                f"(a torch.library namespace of your own exists once the module that defines its "
                f"ops is imported: import it first)")
    else:
        exists = f"{ns}.{op}" in known
    if not exists:
        pool = sorted(k for k in known if k.startswith(ns + "."))
        close = (difflib.get_close_matches(f"{ns}.{op}", pool, n=1, cutoff=0.6)
                 or difflib.get_close_matches(f"{ns}.{op}", sorted(known), n=1, cutoff=0.6))
        hint = f"; the closest known op is {_spelt(name, close[0])!r}" if close else ""
        return f"{name!r} names no registered op{hint}"
    if len(parts) == 3 and ns != "higher_order":
        overloads = getattr(getattr(torch.ops, ns), op).overloads()
        if parts[2] not in overloads:
            return (f"{name!r}: op {_spelt(name, f'{ns}.{op}')!r} has no overload {parts[2]!r}; "
                    f"its overloads: {', '.join(sorted(overloads))} (or name the op alone)")
    return None


def split_ops_problem(names: Any) -> str | None:
    """What is wrong with the first bad entry of ``names`` (a ``split_ops`` value) when
    the option is set (an unknown namespace waits for the compile), or None."""
    for name in names:
        problem = split_op_problem(name, unknown_namespace_ok=True)
        if problem is not None:
            return problem
    return None


def clean_split_ops(names: Any) -> tuple[str, ...]:
    """The stored ``split_ops``: ``torch.ops.aten.mm`` becomes ``aten.mm``."""
    return tuple(n.removeprefix(TORCH_OPS) for n in names)

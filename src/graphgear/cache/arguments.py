"""What :func:`~graphgear.cache.function.cache_compile` says about a function: its
arguments checked before anything compiles, and why an entry is ``unsupported`` (with the
fix a warning names)."""

from __future__ import annotations

import inspect
import pickle
from typing import Any

from torch import nn

from ..config import CompilerConfig

__all__ = ["check_arguments", "name_of", "unguardable_reason", "unsupported_fix", "unsupported_reason"]


def name_of(fn: Any) -> str:
    target = type(fn) if isinstance(fn, nn.Module) else fn
    name = getattr(target, "__qualname__", None) or type(target).__name__
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in name)[:60]


def unsupported_reason(error: BaseException) -> str:
    """The first line of the innermost error of a failed precompile (torch wraps them)."""
    while error.__cause__ is not None and not isinstance(error, (TypeError, pickle.PicklingError)):
        error = error.__cause__
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def unguardable_reason(guards: list[str]) -> str:
    """Why a function whose globals only dynamo's identity guards could check is not
    stored: the globals, by name."""
    names = sorted({g.split("'")[1] if g.startswith("G['") else g for g in guards})
    return (f"the global(s) {', '.join(names)} of the traced code can only be checked by "
            f"identity (guards {', '.join(guards[:4])}), which no later process can check")[:300]


def unsupported_fix(reason: str) -> str:
    if "checked by identity" in reason:
        return ("bind such a global to a function or class defined by name at module level "
                "(def, not a lambda or an instance), or pass it to the function as an argument")
    if "local scope" in reason or "<locals>" in reason:
        return ("define the class or function at module level (not inside a function), so a "
                "later process can import it by name")
    if "pickle" in reason.lower():
        return ("keep objects that cannot be pickled (locks, open files, compiled wrappers) out of "
                "what the function reads: pass them as arguments or hold them outside the module")
    return "make the function compile with torch.compile(fullgraph=True), or call it uncached"


def check_arguments(fn: Any, config: Any, dynamic: Any, rank: Any) -> None:
    """:func:`cache_compile`'s arguments, checked before anything is compiled."""
    where = "graphgear.inference.cache_compile"
    if not callable(fn):
        raise TypeError(f"{where}: fn must be a function, an nn.Module or a module's bound method, got "
                        f"{type(fn).__name__} ({fn!r:.60}). Fix: pass the function itself, not the "
                        f"result of calling it: cache_compile(step), not cache_compile(step(x)).")
    target = type(fn).forward if isinstance(fn, nn.Module) else getattr(fn, "__func__", fn)
    if inspect.isgeneratorfunction(target) or inspect.isasyncgenfunction(target):
        raise TypeError(f"{where}: fn {name_of(fn)} is a generator function, which cannot be compiled "
                        f"as one graph (each next() resumes its frame). Fix: cache the function the "
                        f"generator calls for each item, cache_compile(step), and keep the loop in the "
                        f"generator.")
    if config is not None and not isinstance(config, CompilerConfig):
        raise TypeError(f"{where}: config must be a graphgear.CompilerConfig, got {type(config).__name__}. "
                        f"Fix: pass graphgear.CompilerConfig.from_dict(d) for a dict d of options, or "
                        f"leave config=None for the defaults.")
    if not isinstance(dynamic, bool):
        raise TypeError(f"{where}: dynamic must be True or False, got {dynamic!r} "
                        f"({type(dynamic).__name__}). Fix: dynamic=True keeps the dims marked by "
                        f"set_dim_gears dynamic; dynamic=False compiles every dim static.")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise TypeError(f"{where}: rank must be None or an int >= 0, got {rank!r} ({type(rank).__name__}). "
                        f"Fix: pass this process's rank as an int (torch.distributed.get_rank()), or "
                        f"None for a single process.")
    if rank is not None and rank < 0:
        raise ValueError(f"{where}: rank must be None or an int >= 0, got {rank!r}. Fix: pass this "
                         f"process's rank (torch.distributed.get_rank()), or None for a single process.")

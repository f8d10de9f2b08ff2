"""What a compile cache key is made of (:func:`key_parts`), and the cheap per-call
summary that finds a known key without building it again (:func:`_signature`).

The key covers: torch's and graphgear's versions, the ``CompilerConfig``, the source of
the function (a module's class, a bound method's class and function), the passes'
version, Inductor's config, the inputs' gears and their specs (dtype, device, shape with
geared dims left out, ``requires_grad``), ``dynamic``, the rank, and the module's
structure (parameter and buffer names, dtypes, shapes, devices; every submodule's
class). Weight values are not part of it: they are inputs at run time.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

import torch
from torch import nn

from .._torch.serialize import inductor_config_digest
from ..config import CompilerConfig
from ..gears import get_dim_gears
from ..passes import PASSES_VERSION

__all__ = ["GearsOf", "key_parts"]


def _graphgear_version() -> str:
    try:
        return metadata.version("graphgear")
    except metadata.PackageNotFoundError:
        return "unknown"


def _source_of(fn: Any) -> str:
    """The source the code hash covers: a module's class (its ``forward`` included) or a
    function; the code object's bytes when no source is available."""
    targets: list[Any] = []
    if isinstance(fn, nn.Module):
        targets = [type(fn)]
    elif inspect.ismethod(fn):
        targets = [type(fn.__self__), fn.__func__]
    else:
        targets = [fn]
    parts = []
    for t in targets:
        try:
            parts.append(inspect.getsource(t))
        except (OSError, TypeError):
            code = getattr(t, "__code__", None)
            parts.append(repr(code.co_code) if code is not None else repr(t))
    return "\n".join(parts)


GearsOf = Callable[[torch.Tensor], dict[int, list[int]]]


def _spec(x: Any, gears_of: GearsOf = get_dim_gears) -> Any:
    if isinstance(x, torch.Tensor):
        gears = {str(d): list(s) for d, s in sorted(gears_of(x).items())}
        return {"dtype": str(x.dtype), "device": str(x.device), "shape": list(x.shape),
                "requires_grad": x.requires_grad, "gears": gears}
    if isinstance(x, (list, tuple)):
        return [_spec(v, gears_of) for v in x]
    if isinstance(x, dict):
        return {str(k): _spec(v, gears_of) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (int, float, bool, str)) or x is None:
        return {"type": type(x).__name__, "value": x}
    return {"type": type(x).__qualname__}


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _signature(x: Any, gears_of: GearsOf = get_dim_gears) -> Any:
    """A cheap hashable summary of a call's inputs (what :func:`_spec` digests)."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, x.device, x.requires_grad,
                tuple(sorted((d, tuple(g)) for d, g in gears_of(x).items())))
    if isinstance(x, (list, tuple)):
        return tuple(_signature(v, gears_of) for v in x)
    if isinstance(x, dict):
        return tuple(sorted(((str(k), _signature(v, gears_of)) for k, v in x.items()), key=lambda kv: kv[0]))
    if isinstance(x, (int, float, bool, str)) or x is None:
        return (type(x), x)
    return type(x)


def key_parts(fn: Any, config: CompilerConfig, args: tuple[Any, ...], kwargs: dict[str, Any],
              dynamic: bool, rank: int | None, gears_of: GearsOf = get_dim_gears) -> dict[str, str]:
    """Every part of the cache key, each a short string (versions) or a sha256."""
    specs = {"args": _spec(list(args), gears_of), "kwargs": _spec(kwargs, gears_of)}
    gears = [s.get("gears") for s in _walk_specs(specs) if s.get("gears")]
    shapes_without_gears = _digest(_strip_geared(specs))
    return {
        "torch": torch.__version__,
        "graphgear": _graphgear_version(),
        "config": _digest(config.as_dict()),
        "code": hashlib.sha256(_source_of(fn).encode()).hexdigest(),
        "passes": str(PASSES_VERSION),
        "inductor": inductor_config_digest(),
        "gears": _digest(gears),
        "inputs": shapes_without_gears,
        "dynamic": str(bool(dynamic)),
        "rank": str(rank),
        "module": _module_digest(fn),
    }


def _module_digest(fn: Any) -> str:
    """The structure of a module (``fn`` or a bound method's owner): every parameter's and
    buffer's name, dtype, shape and device, and every module's class; its values are not
    part of the key (they are inputs at run time)."""
    module = fn if isinstance(fn, nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(module, nn.Module):
        return "-"
    state = [(n, str(t.dtype), list(t.shape), str(t.device))
             for n, t in [*module.named_parameters(), *module.named_buffers()]]
    classes = [(n, type(m).__qualname__) for n, m in module.named_modules()]
    return _digest([state, classes])


def _walk_specs(obj: Any) -> Iterator[dict[str, Any]]:
    if isinstance(obj, dict):
        if "dtype" in obj:
            yield obj
            return
        for v in obj.values():
            yield from _walk_specs(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk_specs(v)


def _strip_geared(obj: Any) -> Any:
    """The specs with geared dims' sizes left out: any size in the gears hits one entry."""
    if isinstance(obj, dict):
        if "dtype" in obj:
            shape = [None if str(d) in obj["gears"] else s for d, s in enumerate(obj["shape"])]
            return {**obj, "shape": shape}
        return {k: _strip_geared(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strip_geared(v) for v in obj]
    return obj

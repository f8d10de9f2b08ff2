"""Building every gear before serving: :func:`precompile_gears` and the state it sets
for the graphs its call reaches (:func:`precompiling`)."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

__all__ = ["precompile_gears", "precompiling"]

# Set by precompile_gears around its one call of the compiled model, read by the
# gear guard that call reaches (dynamo and AOTAutograd sit between, with no way to pass
# an argument through); a context variable, so it holds for that call alone.
_PRECOMPILE: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "graphgear_precompile_gears", default=None)


def precompiling() -> dict[str, Any] | None:
    """The running ``precompile_gears`` call's state (its progress bar), else None."""
    return _PRECOMPILE.get()


def precompile_gears(fn: Callable[..., Any], *args: Any, progress: bool = False, **kwargs: Any) -> Any:
    """Compile (and capture) every gear of every graph a call touches, before serving.

    ``graphgear.inference.precompile_gears(compiled_model, *args, **kwargs)`` calls the
    compiled model once with ``args``; each geared graph then builds all its gears on
    inputs derived from ``args`` (inputs it mutates, such as KV caches, are restored).
    Returns the call's output. ``progress=True`` shows a progress bar (tqdm).
    """
    bar = tqdm(desc="graphgear: building gears", unit="gear", leave=False) if progress else None
    token = _PRECOMPILE.set({"bar": bar})
    try:
        return fn(*args, **kwargs)
    finally:
        _PRECOMPILE.reset(token)
        if bar is not None:
            bar.close()

"""graphgear's exception types."""

from __future__ import annotations


class GraphgearError(Exception):
    """Base of graphgear's own errors (each is also a ValueError or RuntimeError)."""


class ConfigError(GraphgearError, ValueError):
    """An unknown option, or a value outside an option's allowed set."""


class GearError(GraphgearError, ValueError):
    """Bad gears: a size outside the gears, bad ``set_dim_gears`` input, a zip of unequal
    lists, or more than 100 gear combinations."""


class CaptureError(GraphgearError, RuntimeError):
    """``capture_config.fallback="raise"`` met something it cannot capture."""


def graphgear_error(exc: BaseException) -> BaseException | None:
    """The graphgear error inside ``exc``, if any.

    Dynamo wraps a backend's error in ``BackendCompilerFailed`` and, in torch 2.13,
    re-raises that ``from None``: the original is then its ``inner_exception`` (and its
    ``__context__``), not its ``__cause__``. This follows all three links.
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, GraphgearError):
            return e
        todo += [getattr(e, "inner_exception", None), e.__cause__, e.__context__]
    return None

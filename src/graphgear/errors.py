"""graphgear's exception types.

Every error graphgear raises on purpose derives from :class:`GraphgearError`, and also
from the builtin error it has always been (``ValueError`` or ``RuntimeError``), so an
``except ValueError`` written before the base existed still catches it. All are exported
at top level: ``graphgear.GraphgearError``, ``graphgear.ConfigError``,
``graphgear.GearError``, ``graphgear.CaptureError``.
"""

from __future__ import annotations

__all__ = ["REPORT_BUG", "CaptureError", "ConfigError", "GearError", "GraphgearError", "graphgear_error"]

#: How a message about a graphgear bug ends: where to report it and what to attach.
REPORT_BUG = "report it, with the output of `graphgear env`, on the project's issue tracker"


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

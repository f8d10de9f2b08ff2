"""graphgear's exception types."""

from __future__ import annotations


class GearError(ValueError):
    """Bad gears: a size outside the gears, bad ``set_dim_gears`` input, a zip of unequal
    lists, or more than 100 gear combinations."""


class CaptureError(RuntimeError):
    """``capture_config.fallback="raise"`` met something it cannot capture."""

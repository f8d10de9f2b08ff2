"""Inference helpers, as in TorchAir's ``torchair.inference``."""

from __future__ import annotations

from .gears import precompile_gears, set_dim_gears

__all__ = ["precompile_gears", "set_dim_gears"]

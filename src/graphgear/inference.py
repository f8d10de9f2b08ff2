"""Inference helpers, as in TorchAir's ``torchair.inference``."""

from __future__ import annotations

from .dispatch import precompile_gears
from .gears import set_dim_gears

__all__ = ["precompile_gears", "set_dim_gears"]

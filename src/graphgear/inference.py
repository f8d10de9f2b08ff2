"""Inference helpers, as in TorchAir's ``torchair.inference``."""

from __future__ import annotations

from .gears import set_dim_gears

__all__ = ["set_dim_gears"]

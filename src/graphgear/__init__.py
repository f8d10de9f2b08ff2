"""graphgear: a graph-capture backend for ``torch.compile``.

>>> import torch, graphgear
>>> config = graphgear.CompilerConfig()
>>> config.mode = "reduce-overhead"
>>> model = torch.compile(model, backend=graphgear.get_backend(compiler_config=config))
"""

from __future__ import annotations

from . import cache, inference
from .backend import get_backend, get_compiler
from .config import CompilerConfig
from .errors import CaptureError, ConfigError, GearError, GraphgearError
from .gears import set_dim_gears
from .passes.patterns import register_replacement
from .stats import mark_warm, reset, stats

#: the package version; its one source (pyproject.toml reads it: ``[tool.setuptools.dynamic]``)
__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "CompilerConfig",
    "ConfigError",
    "GearError",
    "GraphgearError",
    "__version__",
    "cache",
    "get_backend",
    "get_compiler",
    "inference",
    "mark_warm",
    "register_replacement",
    "reset",
    "set_dim_gears",
    "stats",
]

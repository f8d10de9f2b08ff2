"""Joint-graph fusion passes (``experimental_config.fx_passes``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import fx


def joint_graph_passes(gm: fx.GraphModule, example_inputs: Sequence[Any], config: Any) -> int:
    """Run the joint-graph fusion passes on ``gm`` in place; returns the number of rewrites."""
    return 0

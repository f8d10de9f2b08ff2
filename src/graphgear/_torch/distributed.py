"""torch.distributed's functional collectives
(``torch.distributed._functional_collectives``), the traceable all-reduce.

Checked on 2.13 (CPU build; 2.11 to 2.14 have it). Imported on first use, so
``import graphgear`` does not load torch.distributed's modules. If it moved, the
hand-written tensor-parallel decoder (``graphgear.toy_decoder_tp``) could not reduce its
row-parallel outputs.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["functional_all_reduce"]


def functional_all_reduce(t: torch.Tensor, op: str, group: Any) -> torch.Tensor:
    """``torch.distributed._functional_collectives.all_reduce(t, op, group)``: the
    traceable all-reduce (a new tensor; dynamo and AOTAutograd keep it in the graph as
    ``_c10d_functional.all_reduce`` + ``wait_tensor``).

    Checked on 2.13; DTensor's own redistribution and dynamo's remap of
    ``dist.all_reduce`` (``traceable_collective_remaps``) use the same module in 2.13
    (2.11 to 2.14). Imported here, on first use, so ``import graphgear`` does not load
    torch.distributed's modules. If it moved, the hand-written tensor-parallel decoder
    (``graphgear.toy_decoder_tp``) could not reduce its row-parallel outputs."""
    import torch.distributed._functional_collectives as fc

    return fc.all_reduce(t, op, group)

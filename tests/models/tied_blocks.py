"""Models that call one block several times in one forward, as users write them: a
weight-tied block (the same module twice), a module reused in a loop, each with a graph
break inside the block, so that dynamo compiles the block's graphs once and the forward
calls them again while their first outputs are still in use."""

from __future__ import annotations

import torch
from torch import nn


class BreakBlock(nn.Module):
    """A linear layer, a graph break (``torch._dynamo.graph_break()``), pointwise work."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        torch._dynamo.graph_break()
        return y * 2 + 1


class ItemBlock(nn.Module):
    """A block that reads a value back to the host (``.item()``: a graph break) and
    scales by it."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        scale = float(y.abs().amax().item()) + 1.0
        return y / scale


class TiedTwice(nn.Module):
    """``a = block(x); b = block(a); return a + b``: the first output is used after the
    block ran again."""

    def __init__(self, block: nn.Module | None = None) -> None:
        super().__init__()
        self.block = block if block is not None else BreakBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.block(x)
        b = self.block(a)
        return a + b


class ReusedInLoop(nn.Module):
    """One block applied ``n`` times, every intermediate kept and summed at the end."""

    def __init__(self, n: int = 3, block: nn.Module | None = None) -> None:
        super().__init__()
        self.n = n
        self.block = block if block is not None else BreakBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = []
        h = x
        for _ in range(self.n):
            h = self.block(h)
            outs.append(h)
        return torch.stack(outs).sum(0)

"""Models made of repeated blocks, as users write them: a stack of identical residual
blocks in an ``nn.ModuleList``, one whose blocks differ by a Python constant, one whose
blocks write a per-block cache in place, and one whose block returns a view of its
input."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """Pre-norm MLP with a residual: ``x + w2(gelu(w1(norm(x)))) * scale``."""

    def __init__(self, width: int = 16, scale: float = 1.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.w1 = nn.Linear(width, 2 * width)
        self.w2 = nn.Linear(2 * width, width)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.nn.functional.gelu(self.w1(self.norm(x)))) * self.scale


class Stack(nn.Module):
    """``depth`` blocks in a ModuleList, then a head; ``scales`` gives each block its own
    constant (baked into the graph: blocks with different scales are different code)."""

    def __init__(self, depth: int = 4, width: int = 16, scales: list[float] | None = None) -> None:
        super().__init__()
        scales = scales or [1.0] * depth
        self.blocks = nn.ModuleList(Block(width, s) for s in scales)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class CachedBlock(nn.Module):
    """A block that writes its input's projection into row ``pos`` of its own cache
    (in place, as a KV cache) and reads the whole cache back."""

    def __init__(self, width: int = 16, rows: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.register_buffer("cache", torch.zeros(rows, width))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.index_copy_(0, pos, self.proj(x).tanh())
        mixed = torch.softmax(x @ self.cache.t(), dim=-1) @ self.cache
        return x + self.out(mixed).relu() * 0.5


class CachedStack(nn.Module):
    def __init__(self, depth: int = 3, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(CachedBlock(width) for _ in range(depth))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x, pos)
        return x


class ViewBlock(nn.Module):
    """Returns a view of its input besides a new tensor (an output aliasing an input)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.norm(self.lin(x)).relu() * 2 - 1
        return y.sigmoid() + x, x.view(-1)


class ViewStack(nn.Module):
    def __init__(self, depth: int = 3, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ViewBlock(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = []
        for b in self.blocks:
            x, v = b(x)
            flat.append(v)
        return x.sum() + torch.stack(flat).sum()

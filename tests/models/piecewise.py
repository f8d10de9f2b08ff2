"""Models with a split op in the middle, as a user of piecewise capture writes them: a
custom op that reads a Python int (a stand-in for paged attention), a KV cache written in
place around it, and attention through SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.library.custom_op("ggtest::window_sum", mutates_args=())
def window_sum(x: torch.Tensor, n: int) -> torch.Tensor:
    """The sum of the first ``n`` columns of ``x`` per row; ``n`` out of range raises."""
    if not 0 < n <= x.shape[1]:
        raise ValueError(f"window_sum: n={n} is outside 1..{x.shape[1]}")
    return x[:, :n].sum(dim=1, keepdim=True)


@window_sum.register_fake
def _(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], 1)


def _window_sum_backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    x_shape, n = ctx.x_shape, ctx.n  # type: ignore[attr-defined]
    out = grad.new_zeros(x_shape)
    out[:, :n] = grad
    return out, None


def _window_sum_setup(ctx: object, inputs: tuple[torch.Tensor, int], output: torch.Tensor) -> None:
    ctx.x_shape, ctx.n = inputs[0].shape, inputs[1]  # type: ignore[attr-defined]


window_sum.register_autograd(_window_sum_backward, setup_context=_window_sum_setup)

WINDOW_SUM = "ggtest::window_sum"


class WindowNet(nn.Module):
    """linear -> window_sum(h, n) -> linear: piece, split node, piece."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        s = window_sum(h, n)
        return self.b(h * s) + 1


class CachedWindowNet(nn.Module):
    """Writes a row of its buffer ``cache`` in place before the split op and reads the
    whole cache after it: an input mutation inside a captured piece."""

    def __init__(self, width: int = 8, rows: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("cache", torch.zeros(rows, width))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, n: int) -> torch.Tensor:
        self.cache.index_copy_(0, pos, self.lin(x))
        s = window_sum(self.cache, n)
        return (self.cache * s).sum(0, keepdim=True)


class Attention(nn.Module):
    """Projections around one SDPA call (the op a piecewise server leaves uncaptured)."""

    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, w))


#: the addresses of the caches ``ggtest::cache_write`` wrote, in call order (a test clears
#: it): a split node that runs the op on a clone shows as an address of no cache
CACHE_WRITES: list[int] = []


@torch.library.custom_op("ggtest::cache_write", mutates_args=("cache",))
def cache_write(cache: torch.Tensor, kv: torch.Tensor, pos: int) -> None:
    """``cache[:, pos] = kv`` in place (the shape of a paged-attention cache write);
    ``pos`` out of range raises."""
    if not 0 <= pos < cache.shape[1]:
        raise ValueError(f"cache_write: pos={pos} is outside 0..{cache.shape[1] - 1}")
    CACHE_WRITES.append(cache.data_ptr())
    cache[:, pos] = kv


CACHE_WRITE = "ggtest::cache_write"


def write_then_read(x: torch.Tensor, cache: torch.Tensor, pos: int) -> torch.Tensor:
    """piece (tanh of a product), split node (the cache write at ``pos``), piece (reads
    the whole cache)."""
    h = torch.tanh(x @ x.T)
    cache_write(cache, h, pos)
    return (cache.sum(1) * h).sum(-1)


def write_two_layers(x: torch.Tensor, cache: torch.Tensor, pos: int) -> torch.Tensor:
    """Two cache writes at ``pos``, each into a layer (a view) of one cache, a piece
    between them; the last piece reads both layers."""
    h = torch.tanh(x @ x.T)
    cache_write(cache[0], h, pos)
    g = torch.sigmoid(h @ h)
    cache_write(cache[1], g, pos)
    return (cache.sum(2) * h).sum(-1) + cache[1].sum()

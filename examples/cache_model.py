"""The model of examples/cache_restart.py, in a module of its own.

graphgear's compile cache keys an entry by, among other things, the source of the
model's class, so every process that serves the model must build it from the same class.
Here it lives at module level in a module of its own, as a user's package holds its
models: the storing process, the loading process and any other script import it from
one place. A class defined inside a function cannot be saved by torch's precompile: it
is served uncached, with one warning naming the fix (``stats()``: ``cache="unsupported"``).
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, HIDDEN, SEQ = 128, 64, 8


class TinyLM(nn.Module):
    """``forward(tokens [batch, SEQ]) -> logits [batch, SEQ, VOCAB]``: an embedding, a
    residual GELU MLP over layer norm, a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.down(nn.functional.gelu(self.up(self.norm(x))))
        return self.head(x)


def build(seed: int = 0) -> TinyLM:
    """The same weights in every process."""
    torch.manual_seed(seed)
    return TinyLM().eval()

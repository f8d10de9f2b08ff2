"""Models written the way users of TorchAir's ``cache_compile`` write them, at module level
in a package of their own (tests/test_cache_patterns.py, tests/cache_patterns_worker.py)."""

from __future__ import annotations

from typing import Any

import torch

from graphgear.config import CompilerConfig
from graphgear.inference import cache_compile


class SelfCachedMLP(torch.nn.Module):
    """TorchAir's documented pattern: the module wraps its own bound method in ``__init__``."""

    def __init__(self, config: CompilerConfig, cache_dir: str) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(16, 32)
        self.l2 = torch.nn.Linear(32, 8)
        self.cached_forward = cache_compile(self._forward, config=config, cache_dir=cache_dir)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cached_forward(x)


class MLP(torch.nn.Module):
    """A plain module, passed whole to ``cache_compile``."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(16, 32)
        self.l2 = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


class TwoStateMLP(MLP):
    """State the caller changes between calls (``residual``): dynamo guards the attribute,
    so each state is an entry of its own for the same input spec."""

    def __init__(self) -> None:
        super().__init__()
        self.residual = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y + x[:, :8] if self.residual else y


class HostReadMLP(torch.nn.Module):
    """A host read in the middle of the step (a count the next layer scales by): in
    reduce-overhead the graph is captured in two pieces around ``.item()``."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(16, 32)
        self.l2 = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        k = int((h > 0).sum().item()) % 5 + 1
        return self.l2(h) * k


def mlp_function(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A plain function."""
    return torch.relu(x @ w).sum(-1, keepdim=True) + x[:, :1]


def logits_of(model: Any) -> Any:
    """A closure over a transformers model."""

    def run(input_ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids).logits

    return run

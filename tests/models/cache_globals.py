"""Functions that read module-level globals, written as a user writes them, for the
compile cache's global guards (tests/test_cache_globals.py, tests/cache_globals_worker.py):
a float scale and a flag read from the environment at import (as a real config flag
is), a global tensor, a helper bound to a global, a global lambda, and the docs' pattern
of a module-level lambda over a model."""

from __future__ import annotations

import os

import torch

SCALE = float(os.environ.get("GG_TEST_SCALE", "1.0"))
FLAG = os.environ.get("GG_TEST_FLAG", "0") == "1"
TABLE = torch.arange(4, dtype=torch.float32) * float(os.environ.get("GG_TEST_TABLE", "1.0"))
ACTIVATION = torch.relu if os.environ.get("GG_TEST_ACT", "relu") == "relu" else torch.tanh
SHIFT = lambda x: x + 3  # noqa: E731  (a global whose identity has no name)


class Net(torch.nn.Module):
    def __init__(self, fill: float) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.fill_(fill)
            self.lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


net = Net(float(os.environ.get("GG_TEST_NET", "1.0"))).eval()


def scaled(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * SCALE


def flagged(x: torch.Tensor) -> torch.Tensor:
    return x + 1 if FLAG else x - 1


def tabled(x: torch.Tensor) -> torch.Tensor:
    return x * TABLE


def activated(x: torch.Tensor) -> torch.Tensor:
    return ACTIVATION(x - 0.5)


def shifted(x: torch.Tensor) -> torch.Tensor:
    return SHIFT(x)


step = lambda x: net(x)  # noqa: E731  (the docs' pattern: a module-level lambda over a model)

FUNCTIONS = ("scaled", "flagged", "tabled", "activated", "shifted", "step")

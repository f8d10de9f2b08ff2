"""Shared test setup: one on-disk Inductor cache for every test and process (private to
the user: ``graphgear.cache.store``), offline Hugging Face, deterministic seeds."""

from __future__ import annotations

import os

from graphgear.cache.store import use_private_inductor_cache

use_private_inductor_cache()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

import graphgear  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_state():
    """Every test starts with no compiled graphs and a fixed seed."""
    torch.manual_seed(0)
    graphgear.reset()
    yield
    graphgear.reset()

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

_MODULE_CALL = torch.nn.Module.__call__


@pytest.fixture(autouse=True)
def _fresh_state():
    """Every test starts with no compiled graphs and a fixed seed. A test that leaves an
    FX trace's process-wide patch of ``nn.Module.__call__`` behind (two traces at once in
    two threads restore each other's patch) fails here, by name, and the patch is undone
    so the tests after it do not all fail with dynamo's "symbolically trace" error."""
    torch.manual_seed(0)
    graphgear.reset()
    yield
    graphgear.reset()
    leaked = torch.nn.Module.__call__ is not _MODULE_CALL
    if leaked:
        torch.nn.Module.__call__ = _MODULE_CALL
    assert not leaked, "this test left an FX trace's patch of torch.nn.Module.__call__ in place"

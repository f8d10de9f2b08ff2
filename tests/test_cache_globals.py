"""The compile cache and module-level globals (issue 43): a global the traced code reads
(a float, a flag, a tensor, a model behind a module-level lambda, a function bound to a
global) that changes, in this process or in the next, is never served the entry's stale
value: the entry's guards on it are kept and checked on the live globals, the graph reads
global tensors and models live, and a global whose identity no later process can check
makes the function unsupported with one warning naming it. The functions live in their
own module (tests/models/cache_globals.py), whose globals a second process reads from
the environment at import (tests/cache_globals_worker.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import graphgear
from graphgear.cache.function import cache_compile
from tests.models import cache_globals

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "cache_globals_worker.py"
X = torch.linspace(-0.5, 1.0, 4)  # sums to 1: a model of constant weights gives it back


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "gg"
    folder.mkdir(mode=0o700)
    return folder


def _serve(fn: Any) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return fn(X), getattr(cache_globals, fn.fn.__name__)(X)


def _worker(folder: Path, function: str, **env: str) -> dict[str, Any]:
    full = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", **env)
    p = subprocess.run([sys.executable, str(WORKER), function, "--dir", str(folder)],
                       capture_output=True, text=True, env=full, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    out["log"] = p.stdout + p.stderr
    return out


def test_a_rebound_float_global_is_not_served_stale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: after ``SCALE = SCALE * 10`` the cached function kept returning sin(x) * 1
    (0.8415 where eager gives 8.4147)."""
    folder = _folder(tmp_path)
    fn = cache_compile(cache_globals.scaled, cache_dir=str(folder))
    out, eager = _serve(fn)
    assert torch.equal(out, eager) and graphgear.stats().graphs[-1].cache == "stored"
    monkeypatch.setattr(cache_globals, "SCALE", cache_globals.SCALE * 10)
    out, eager = _serve(fn)
    assert torch.allclose(out, eager) and eager.abs().max() > 8
    again = cache_compile(cache_globals.scaled, cache_dir=str(folder))  # the entries, loaded
    out, eager = _serve(again)
    assert torch.allclose(out, eager) and graphgear.stats().graphs[-1].cache == "hit"
    monkeypatch.setattr(cache_globals, "SCALE", 1.0)  # back: the first entry serves it again
    out, eager = _serve(again)
    assert torch.allclose(out, eager)


def test_a_rebound_global_tensor_is_read_live_and_its_shape_guarded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: a global tensor rebound to new values or to a new shape kept the old tensor,
    with no error. New values are read by the same entry (no compile); a new shape is an
    entry of its own."""
    fn = cache_compile(cache_globals.tabled, cache_dir=str(_folder(tmp_path)))
    out, eager = _serve(fn)
    assert torch.equal(out, eager)
    graphs = len(graphgear.stats().graphs)
    monkeypatch.setattr(cache_globals, "TABLE", torch.full((4,), 5.0))
    out, eager = _serve(fn)
    assert torch.equal(out, eager) and len(graphgear.stats().graphs) == graphs  # read live, not compiled
    monkeypatch.setattr(cache_globals, "TABLE", torch.full((2, 4), 7.0))
    out, eager = _serve(fn)
    assert out.shape == (2, 4) and torch.equal(out, eager)


def test_a_flipped_bool_flag_is_not_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Was: the cached function kept the branch of the first call's flag."""
    fn = cache_compile(cache_globals.flagged, cache_dir=str(_folder(tmp_path)))
    out, eager = _serve(fn)
    assert torch.equal(out, eager)
    monkeypatch.setattr(cache_globals, "FLAG", not cache_globals.FLAG)
    out, eager = _serve(fn)
    assert torch.equal(out, eager) and torch.equal(out, X + 1)


def test_the_lambda_over_a_model_uses_the_model_bound_now(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The docs' pattern, a module-level lambda over a global model. Was: after
    ``net = new_model`` it kept the old model's weights (and the entry could not be
    stored: torch's precompile cannot pickle the model the graph reads)."""
    folder = _folder(tmp_path)
    fn = cache_compile(cache_globals.step, cache_dir=str(folder))
    with torch.no_grad():
        assert torch.allclose(fn(X), cache_globals.net(X))
    assert graphgear.stats().graphs[-1].cache == "stored"
    monkeypatch.setattr(cache_globals, "net", cache_globals.Net(2.0).eval())
    with torch.no_grad():
        out, eager = fn(X), cache_globals.net(X)
    assert torch.allclose(out, eager) and torch.allclose(out, torch.full((4,), 2 * float(X.sum())))


def test_a_function_bound_to_a_global_is_checked_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``ACTIVATION = torch.relu``: dynamo guards it by identity, which torch cannot store;
    the entry checks it by name (``torch:relu``) instead, so a rebinding is not served
    the old function."""
    folder = _folder(tmp_path)
    fn = cache_compile(cache_globals.activated, cache_dir=str(folder))
    out, eager = _serve(fn)
    assert torch.equal(out, eager) and graphgear.stats().graphs[-1].cache == "stored"
    monkeypatch.setattr(cache_globals, "ACTIVATION", torch.tanh)
    out, eager = _serve(fn)
    assert torch.allclose(out, eager) and (out < 0).any()


def test_a_global_whose_identity_has_no_name_is_unsupported_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A global lambda can only be guarded by identity, which no later process can check:
    the function is not stored (``cache="unsupported"``), one warning names the global,
    and the uncached function follows its rebinding."""
    folder = _folder(tmp_path)
    fn = cache_compile(cache_globals.shifted, cache_dir=str(folder))
    with caplog.at_level(logging.WARNING, logger="graphgear.cache.function"):
        out, eager = _serve(fn)
        monkeypatch.setattr(cache_globals, "SHIFT", lambda x: x * 10)
        out2, eager2 = _serve(fn)
    assert torch.equal(out, eager) and torch.equal(out2, eager2)
    assert graphgear.stats().graphs[-1].cache == "unsupported"
    warnings = [r.getMessage() for r in caplog.records if "cannot be stored" in r.getMessage()]
    assert len(warnings) == 1 and "SHIFT" in warnings[0], warnings
    assert not list(folder.rglob("*.ggc"))


@pytest.mark.slow
@pytest.mark.parametrize(("function", "env", "served"), [
    ("scaled", {"GG_TEST_SCALE": "10"}, "stored"),  # a constant in the graph: an entry of its own
    ("flagged", {"GG_TEST_FLAG": "1"}, "stored"),
    ("activated", {"GG_TEST_ACT": "tanh"}, "stored"),
    ("tabled", {"GG_TEST_TABLE": "5"}, "hit"),  # a graph input: the entry reads this process's tensor
    ("step", {"GG_TEST_NET": "2"}, "hit"),
])
def test_a_second_process_with_another_global_is_not_served_the_first_ones(
        tmp_path: Path, function: str, env: dict[str, str], served: str) -> None:
    """Was: a second process whose global (read from the environment at import) differs
    hit the first process's entry and computed with the first process's value."""
    folder = _folder(tmp_path)
    first = _worker(folder, function)
    assert first["cache"] == ["stored"] and first["out"] == first["eager"], first["log"][-3000:]
    second = _worker(folder, function, **env)
    assert second["eager"] != first["eager"]
    assert torch.allclose(torch.tensor(second["out"]), torch.tensor(second["eager"])), second["log"][-3000:]
    assert second["cache"][-1] == served, second["log"][-3000:]  # after the first's entry, loaded and rejected
    third = _worker(folder, function, **env)  # the second process's own entry, loaded
    assert set(third["cache"]) == {"hit"} and third["out"] == second["out"], third["log"][-3000:]

"""The single-process examples in examples/ run as a user runs them and pass their own checks.

Each script checks its results against eager PyTorch itself (it asserts, prints a
summary and ``ok``); here each runs in a fresh interpreter with this test's environment:
the shared private Inductor cache that tests/conftest.py set (``TORCHINDUCTOR_CACHE_DIR``,
``graphgear.cache.store.use_private_inductor_cache``), offline Hugging Face, and this
checkout's ``src`` first on ``PYTHONPATH``. The 2-rank examples (``ddp_train.py``,
``tp_decode.py``) run under ``torchrun --standalone --nproc-per-node 2`` (gloo on the CPU, a
free local port) and must log their summary on both ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphgear.cache.store import INDUCTOR_ENV_VAR

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _env() -> dict[str, str]:
    """This test's environment, this checkout's ``src`` first on ``PYTHONPATH``."""
    assert os.environ.get(INDUCTOR_ENV_VAR), f"tests/conftest.py should have set {INDUCTOR_ENV_VAR}"
    path = [str(ROOT / "src")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def _run(script: str) -> str:
    """Run ``examples/<script>``; assert it exits 0 and ends with ``ok``; its stdout."""
    p = subprocess.run([sys.executable, str(EXAMPLES / script)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (f"examples/{script} exited {p.returncode}\n--- stdout\n{p.stdout[-3000:]}"
                               f"\n--- stderr\n{p.stderr[-6000:]}")
    lines = p.stdout.strip().splitlines()
    assert lines and lines[-1] == "ok", f"examples/{script} did not end with 'ok':\n{p.stdout[-3000:]}"
    return p.stdout


def _torchrun(script: str, *args: str) -> str:
    """Run ``torchrun --standalone --nproc-per-node 2 examples/<script> <args>``; assert it
    exits 0; its stdout and stderr (the examples log to stderr)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(EXAMPLES / script), *args]
    p = subprocess.run(cmd, cwd=ROOT, env=dict(_env(), OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{' '.join(cmd[2:])} exited {p.returncode}\n{out[-6000:]}"
    return out


def test_a_subprocess_uses_the_suites_inductor_cache() -> None:
    """What every example calls first picks the folder the suite uses, so the examples'
    compiles land in (and are served from) the suite's shared Inductor cache."""
    code = "from graphgear.cache.store import use_private_inductor_cache as u; print(u())"
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == os.environ[INDUCTOR_ENV_VAR], (p.stdout, p.stderr[-3000:])


@pytest.mark.slow  # a transformers model
@pytest.mark.inductor
def test_generate_cpu() -> None:
    out = _run("generate_cpu.py")
    for mode in ("max-autotune", "reduce-overhead"):
        assert f"graphgear {mode}: tokens equal eager's" in out, out


@pytest.mark.inductor
def test_serve_gears() -> None:
    out = _run("serve_gears.py")
    assert "after start-up 0 compiles, 0 captures" in out, out


@pytest.mark.inductor
def test_train_loop() -> None:
    out = _run("train_loop.py")
    for mode in ("reduce-overhead", "max-autotune"):
        assert f"{mode}: 4 SGD steps" in out, out


@pytest.mark.inductor
def test_cache_restart() -> None:
    out = _run("cache_restart.py")
    assert "cache='hit'" in out and "bit for bit equal" in out, out


@pytest.mark.slow  # 2 processes compile
@pytest.mark.distributed
@pytest.mark.inductor
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_ddp_train(mode: str) -> None:
    out = _torchrun("ddp_train.py", "--mode", mode, "--steps", "2")
    for rank in (0, 1):
        assert f"[rank {rank}] step 1: loss" in out and "every gradient equal" in out, out[-3000:]
        assert f"[rank {rank}] {mode}: " in out and " backward: the DDP optimizer's buckets)" in out, out[-3000:]


@pytest.mark.slow  # 2 processes compile
@pytest.mark.distributed
@pytest.mark.inductor
@pytest.mark.parametrize("tp", ["dtensor", "megatron"])
def test_tp_decode(tp: str) -> None:
    out = _torchrun("tp_decode.py", "--tp", tp, "--steps", "4")
    for rank in (0, 1):
        assert f"[rank {rank}] {tp}: 4 steps at batch 2, logits = 1-rank eager" in out, out[-3000:]

"""The CPU graph's reason to exist, measured: the embedded decoder's decode step under
reduce-overhead is at most 0.5x eager's time and at most 1.0x ``torch.compile``'s default,
side by side in one run (``benchmarks/bench_cpu_graph.py``; a few rounds, so slow)."""

from __future__ import annotations

import importlib.util
import os

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.inductor]


def test_cpu_graph_decode_step_meets_the_targets(capsys: pytest.CaptureFixture[str]) -> None:
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_cpu_graph.py")
    spec = importlib.util.spec_from_file_location("bench_cpu_graph", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import torch

    threads = torch.get_num_threads()
    try:
        rc = bench.main(["--steps", "150", "--rounds", "3"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS" in out and "FAIL" not in out

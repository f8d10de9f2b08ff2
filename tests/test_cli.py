"""``graphgear bench``: runs, prints the table, writes JSON, rejects bad arguments."""

from __future__ import annotations

import json

import pytest

from graphgear.cli import main


def test_bench_eager_and_run_json(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--steps", "5", "--warmup", "1", "--modes", "eager", "--no-progress",
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    header = [line for line in text.splitlines() if line.startswith("mode")][0]
    for col in ("mode", "compile s", "median us", "p90 us", "speedup", "max abs diff"):
        assert col in header
    data = json.loads(out.read_text())
    (r,) = data["results"]
    assert r["mode"] == "eager" and r["median_us"] > 0 and r["speedup"] == 1.0


def test_bench_graphgear_mode_batches(capsys) -> None:
    """Two batch sizes become gears of one graph: both run and equal eager."""
    from graphgear.bench import run_bench

    results = run_bench(batch_sizes=[1, 2], steps=4, warmup=1,
                        contenders=["eager", "graphgear max-autotune"], progress=False)
    gg = [r for r in results if r.mode == "graphgear max-autotune"]
    assert len(gg) == 2 and not any(r.error for r in gg)
    assert all(r.max_abs_diff < 1e-4 for r in gg)


@pytest.mark.parametrize("argv, msg", [
    (["bench", "--batch-sizes", "0"], "positive"),
    (["bench", "--batch-sizes", "a,b"], "comma-separated"),
    (["bench", "--steps", "-3"], "positive int"),
    (["bench", "--modes", "turbo"], "unknown"),
    (["bench", "--device", "tpu"], "cpu, cuda or npu"),
])
def test_bench_bad_arguments(argv, msg, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


def test_bench_plot_draws_a_png(tmp_path, capsys) -> None:
    out = tmp_path / "bench.png"
    rc = main(["bench", "--steps", "3", "--warmup", "1", "--modes", "eager", "--batch-sizes", "1,2",
               "--no-progress", "--plot", str(out)])
    assert rc == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plot_without_matplotlib_says_how_to_install(monkeypatch, capsys) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    with pytest.raises(SystemExit) as e:
        main(["bench", "--modes", "eager", "--plot", "x.png"])
    assert e.value.code == 2 and "pip install 'graphgear[plot]'" in capsys.readouterr().err

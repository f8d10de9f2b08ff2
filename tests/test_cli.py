"""The ``graphgear`` command: ``--version``, ``env`` (text and JSON), and ``bench``: its
runs, table, JSON and plot, and the argument conventions shared with ``benchmarks/``
(space-separated lists, one name per contender, errors that name the value and the
allowed ones). Also the packaging facts the command reports (one version source)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import graphgear
from graphgear import env
from graphgear.bench import CONTENDERS, run_bench
from graphgear.bench.models import build_model
from graphgear.cli import _parser, main

ROOT = Path(__file__).resolve().parent.parent
PKG_PARENT = str(Path(graphgear.__file__).resolve().parent.parent)


# ---- --version and packaging ----------------------------------------------------------

def test_version_flag(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"graphgear {graphgear.__version__} (torch ")


def test_python_dash_m_graphgear_version() -> None:
    """``python -m graphgear`` is the same command (``graphgear/__main__.py``)."""
    proc = subprocess.run([sys.executable, "-m", "graphgear", "--version"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": PKG_PARENT}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:2] == ["graphgear", graphgear.__version__]


def test_version_has_one_source_and_package_ships_py_typed() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^version\s*=\s*"', text, re.M) is None, "pyproject must not repeat the version"
    assert 'dynamic = ["version"]' in text and 'attr = "graphgear.__version__"' in text
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", graphgear.__version__)
    assert (Path(graphgear.__file__).parent / "py.typed").is_file()
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def test_errors_share_a_base_and_keep_their_builtin_bases() -> None:
    base = graphgear.GraphgearError
    assert issubclass(graphgear.ConfigError, base) and issubclass(graphgear.ConfigError, ValueError)
    assert issubclass(graphgear.GearError, base) and issubclass(graphgear.GearError, ValueError)
    assert issubclass(graphgear.CaptureError, base) and issubclass(graphgear.CaptureError, RuntimeError)
    assert "graphgear env" in graphgear.errors.REPORT_BUG


# ---- env -----------------------------------------------------------------------------

ENV_LABELS = ("graphgear", "torch", "transformers", "python", "os", "cpu", "vector ISA (Inductor)",
              "C++ compiler", "liveness extension", "Inductor cache", "compile cache", "CUDA", "NPU")


def test_env_text(capsys) -> None:
    assert main(["env", "--no-build"]) == 0
    out = capsys.readouterr().out
    labels = {line.split(":", 1)[0].strip() for line in out.splitlines()[1:]}
    assert set(ENV_LABELS) <= labels, labels
    assert graphgear.__version__ in out


def _is(value, *types) -> bool:
    return value is None and type(None) in types or isinstance(value, tuple(t for t in types if t is not type(None)))


def test_env_json_keys_and_types(capsys) -> None:
    assert main(["env", "--json", "--no-build"]) == 0
    info = json.loads(capsys.readouterr().out)
    none = type(None)
    assert info["graphgear"]["version"] == graphgear.__version__
    assert _is(info["graphgear"]["git_commit"], str, none)
    assert isinstance(info["torch"]["version"], str) and isinstance(info["torch"]["triton"], bool)
    assert _is(info["transformers"], str, none)
    assert isinstance(info["python"]["version"], str) and isinstance(info["os"], str)
    assert _is(info["cpu"]["model"], str, none) and isinstance(info["cpu"]["threads"], int)
    assert _is(info["vector_isa"], str, none)
    assert _is(info["cxx_compiler"]["name"], str, none) and _is(info["cxx_compiler"]["version"], str, none)
    live = info["liveness_extension"]
    assert isinstance(live["status"], str) and _is(live["ok"], bool, none)
    for key in ("inductor", "graphgear_inductor", "compile_cache", "extensions"):
        folder = info["caches"][key]
        assert _is(folder["path"], str, none) and isinstance(folder["exists"], bool)
        assert _is(folder["trusted"], bool, none) and _is(folder["reason"], str, none)
    assert isinstance(info["cuda"]["available"], bool) and isinstance(info["cuda"]["devices"], list)
    assert isinstance(info["npu"]["available"], bool)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in info["variables"].items())


def test_env_says_not_found_for_missing_pieces(monkeypatch) -> None:
    """No transformers, no compiler, no ISA, no CPU name, no git: the report still
    prints, each missing value as "not found"."""
    monkeypatch.setattr(env, "_dist_version", lambda name: None)
    monkeypatch.setattr(env, "inductor_cpp_compiler", lambda: None)
    monkeypatch.setattr(env, "inductor_pick_vec_isa", lambda: None)
    monkeypatch.setattr(env, "cpu_model", lambda: None)
    monkeypatch.setattr(env, "git_commit", lambda: None)
    info = env.collect(build_liveness=False)
    assert info["transformers"] is None and info["cxx_compiler"] == {"name": None, "path": None, "version": None}
    text = dict(line.split(":", 1) for line in env.format_report(info).splitlines())
    for label in ("transformers", "C++ compiler", "vector ISA (Inductor)"):
        assert text[label].strip() == env.NOT_FOUND, (label, text[label])
    assert text["cpu"].strip().startswith(env.NOT_FOUND)
    assert "not a git checkout" in text["graphgear"]
    json.dumps(info)  # still plain data


# ---- bench arguments -------------------------------------------------------------------

def test_bench_lists_are_space_separated() -> None:
    args = _parser().parse_args(["bench", "--batch-sizes", "1", "2", "4", "--contenders", "eager",
                                 "graphgear-serve", "--model", "llama", "--dtype", "bfloat16"])
    assert args.batch_sizes == [1, 2, 4] and args.contenders == ["eager", "graphgear-serve"]
    assert (args.model, args.dtype) == ("llama", "bfloat16")
    defaults = _parser().parse_args(["bench"])
    assert (defaults.model, defaults.dtype, defaults.batch_sizes) == ("toy", "float32", [1])
    assert defaults.contenders == list(CONTENDERS)


@pytest.mark.parametrize("argv, msgs", [
    (["bench", "--batch-sizes", "0"], ["positive int", "'0'"]),
    (["bench", "--batch-sizes", "1,2,4"], ["space-separated", "1 2 4"]),
    (["bench", "--batch-sizes", "a"], ["positive int", "'a'"]),
    (["bench", "--steps", "-3"], ["positive int"]),
    (["bench", "--warmup", "-1"], ["--warmup takes 0 or more steps, got -1"]),
    (["bench", "--contenders", "gg-ma"], ["'gg-ma'", "renamed 'graphgear-max-autotune'", ", ".join(CONTENDERS)]),
    (["bench", "--contenders", "graphgear max-autotune"], ["'graphgear max-autotune'",
                                                          "renamed 'graphgear-max-autotune'"]),
    (["bench", "--contenders", "gg max-autotune"], ["'gg max-autotune'", "renamed 'graphgear-max-autotune'"]),
    (["bench", "--contenders", "gg-ro"], ["renamed 'graphgear-reduce-overhead'"]),
    (["bench", "--contenders", "turbo"], ["unknown contender 'turbo'", ", ".join(CONTENDERS)]),
    (["bench", "--contenders", "eager,torch.compile"], ["space-separated", "eager torch.compile"]),
    (["bench", "--modes", "eager"], ["--modes is now --contenders"]),
    (["bench", "--dtype", "float16"], ["unknown dtype 'float16'", "float32, bfloat16"]),
    (["bench", "--model", "bert"], ["unknown model 'bert'", "toy, llama, qwen2, gpt2"]),
    (["bench", "--device", "tpu"], ["cpu, cuda or npu"]),
])
def test_bench_bad_arguments(argv, msgs, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for msg in msgs:
        assert msg in err, (msg, err)


def test_bench_without_transformers_names_the_fix(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails
    with pytest.raises(SystemExit) as e:
        main(["bench", "--model", "llama"])
    assert e.value.code == 2 and "pip install transformers" in capsys.readouterr().err
    with pytest.raises(ImportError, match="pip install transformers"):
        build_model("qwen2")


def test_run_bench_rejects_old_names() -> None:
    with pytest.raises(graphgear.ConfigError, match=r"unknown contender 'gg max-autotune' \(renamed"):
        run_bench(contenders=["eager", "gg max-autotune"], steps=1, progress=False)


# ---- bench runs ------------------------------------------------------------------------

def test_bench_eager_table_and_json_metadata(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--steps", "5", "--warmup", "1", "--contenders", "eager", "--no-progress",
               "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    header = [line for line in text.splitlines() if line.startswith("contender")][0]
    for col in ("contender", "compile s", "median us", "p90 us", "speedup vs eager",
                "speedup vs torch.compile", "max abs diff"):
        assert col in header
    assert "time vs" not in text
    assert "speedup vs eager (higher is better)" in text
    data = json.loads(out.read_text())
    (r,) = data["results"]
    assert r["contender"] == "eager" and r["median_us"] > 0 and r["speedup_vs_eager"] == 1.0
    assert r["speedup_vs_torch_compile"] is None  # torch.compile did not run: null, not NaN
    meta = data["meta"]
    assert meta["graphgear"] == graphgear.__version__ and isinstance(meta["torch"], str)
    assert isinstance(meta["threads"], int) and meta["threads"] > 0
    assert _is(meta["cpu"], str, type(None)) and _is(meta["git_commit"], str, type(None))
    if meta["git_commit"] is not None:
        assert re.fullmatch(r"[0-9a-f]{40}", meta["git_commit"])
    assert (meta["model"], meta["dtype"], meta["batch_sizes"]) == ("toy", "float32", [1])


def test_bench_graphgear_mode_batches() -> None:
    """Two batch sizes become gears of one graph: both run and equal eager."""
    results = run_bench(batch_sizes=[1, 2], steps=4, warmup=1,
                        contenders=["eager", "graphgear-max-autotune"], progress=False)
    gg = [r for r in results if r.contender == "graphgear-max-autotune"]
    assert len(gg) == 2 and not any(r.error for r in gg)
    assert all(r.max_abs_diff < 1e-4 for r in gg)


@pytest.mark.inductor
def test_bench_llama_quick(capsys) -> None:
    """A transformers Llama (small config, random weights, static cache) in
    reduce-overhead: about 10 s on 2 cores with a warm Inductor cache."""
    rc = main(["bench", "--model", "llama", "--steps", "5", "--warmup", "1", "--rounds", "1",
               "--threads", "1", "--contenders", "eager", "graphgear-reduce-overhead", "--no-progress"])
    assert rc == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()
            if line.startswith(("eager ", "graphgear-"))}
    assert set(rows) == {"eager", "graphgear-reduce-overhead"}
    assert "failed" not in rows["graphgear-reduce-overhead"]
    assert float(rows["graphgear-reduce-overhead"].split()[-1]) < 1e-4  # max abs diff from eager


def test_bench_plot_draws_a_png(tmp_path, capsys) -> None:
    out = tmp_path / "bench.png"
    rc = main(["bench", "--steps", "3", "--warmup", "1", "--contenders", "eager", "--batch-sizes", "1", "2",
               "--no-progress", "--plot", str(out)])
    assert rc == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_plot_without_matplotlib_says_how_to_install(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    with pytest.raises(SystemExit) as e:
        main(["bench", "--contenders", "eager", "--plot", "x.png"])
    assert e.value.code == 2 and "pip install 'graphgear[plot]'" in capsys.readouterr().err

"""The backend: registration, options, get_compiler, stats/reset, dumps and summaries."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import graphgear
from tests.helpers import assert_close
from tests.models import MLP


def _run_eagerly() -> graphgear.CompilerConfig:
    c = graphgear.CompilerConfig()
    c.debug.run_eagerly = True
    return c


def test_listed_without_import() -> None:
    """The entry point registers "graphgear" in a process that never imports graphgear."""
    code = (
        "import sys, torch\n"
        "assert 'graphgear' in torch._dynamo.list_backends(), torch._dynamo.list_backends()\n"
        "f = torch.compile(lambda x: x * 2 + 1, backend='graphgear', options={'run_eagerly': True})\n"
        "x = torch.randn(3)\n"
        "assert torch.equal(f(x), x * 2 + 1)\n"
        "print('ok', 'graphgear' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok True"  # loaded lazily by dynamo, not by the user


def test_options_map_onto_config() -> None:
    f = torch.compile(lambda x: x.sin(), backend="graphgear",
                      options={"run_eagerly": True, "debug.graph_dump.path": "."})
    x = torch.randn(4)
    assert_close(f(x), x.sin())
    (g,) = graphgear.stats().graphs
    assert g.mode == "eager"


def test_unknown_option_key_raises_listing_known() -> None:
    f = torch.compile(lambda x: x + 1, backend="graphgear", options={"capture_limitt": 3})
    with pytest.raises(Exception) as e:
        f(torch.randn(2))
    err = graphgear.errors.graphgear_error(e.value)
    assert isinstance(err, ValueError)
    assert "capture_limitt" in str(err) and "capture_config.capture_limit" in str(err)


def test_torch_compile_mode_kwarg_is_forwarded() -> None:
    backend = graphgear.get_backend(compiler_config=_run_eagerly())
    cfg = backend._config_for_call("reduce-overhead", None)
    assert cfg.mode == "reduce-overhead" and backend.config.mode == "max-autotune"
    with pytest.raises(ValueError, match="not a mode graphgear knows"):
        backend._config_for_call("turbo", None)


def test_get_compiler_aten_graph() -> None:
    def f(x, y):
        return torch.relu(x @ y) + 1

    x, y = torch.randn(3, 4), torch.randn(4, 5)
    gm = make_fx(f)(x, y)
    fn = graphgear.get_compiler(_run_eagerly())(gm, [x, y])
    assert_close(fn(x, y), f(x, y), reduction=4)
    (g,) = graphgear.stats().graphs
    assert g.stage == "inference" and g.num_nodes >= 3


def test_get_compiler_torch_level_graph() -> None:
    model = MLP().eval()
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(2, 16)
    fn = graphgear.get_compiler(_run_eagerly())(gm, [x])
    with torch.no_grad():
        out = fn(x)
    out = out[0] if isinstance(out, list | tuple) else out
    assert_close(out, model(x), reduction=16)


def test_stats_records_and_reset_recompiles() -> None:
    f = torch.compile(lambda x: (x * 3).cos(), backend=graphgear.get_backend(_run_eagerly()))
    x = torch.randn(5)
    f(x)
    s = graphgear.stats()
    (g,) = s.graphs
    assert (g.stage, g.mode, g.compiles) == ("inference", "eager", 1)
    assert g.compile_seconds > 0 and g.inputs
    d = s.as_dict()["graphs"][0]
    for key in ("name", "stage", "mode", "gears", "compiles", "captures", "replays", "fallbacks",
                "compile_seconds", "pool_bytes"):
        assert key in d
    assert "graph_000_inference" in str(s)
    graphgear.reset()
    assert len(graphgear.stats().graphs) == 0
    assert_close(f(x), (x * 3).cos())  # still works, compiles again
    assert len(graphgear.stats().graphs) == 1


@pytest.mark.parametrize("kind", ["txt", "py"])
def test_graph_dump_files_per_stage_in_order(tmp_path, kind: str) -> None:
    cfg = _run_eagerly()
    cfg.debug.graph_dump.type = kind
    cfg.debug.graph_dump.path = str(tmp_path)
    model = MLP()
    compiled = torch.compile(model, backend=graphgear.get_backend(cfg))
    compiled(torch.randn(2, 16)).sum().backward()
    files = sorted(os.listdir(tmp_path))
    assert all(f.endswith("." + kind) for f in files)
    stages = [f.split("_", 2)[2] for f in files]
    # dynamo graph first, then forward received/final, then backward received/final
    assert stages[0] == f"dynamo_dynamo.{kind}"
    fw = [i for i, s in enumerate(stages) if "forward" in s]
    bw = [i for i, s in enumerate(stages) if "backward" in s]
    assert fw and bw and max(fw) < min(bw)
    text = (tmp_path / files[1]).read_text()
    if kind == "txt":
        assert text.splitlines()[0].split()[:5] == ["opcode", "name", "target", "args", "kwargs"]
        assert "placeholder" in text and "aten.mm" in text or "aten.addmm" in text
    else:
        assert "def forward" in text and "torch.ops.aten" in text


def test_fx_summary_csv(tmp_path) -> None:
    cfg = _run_eagerly()
    cfg.debug.fx_summary.type = "csv"
    cfg.debug.fx_summary.path = str(tmp_path)
    with torch.no_grad():
        torch.compile(MLP().eval(), backend=graphgear.get_backend(cfg))(torch.randn(2, 16))
    (name,) = os.listdir(tmp_path)
    rows = list(csv.DictReader(open(tmp_path / name)))
    assert set(rows[0]) == {"op", "count", "supported", "note"}
    ops = {r["op"]: int(r["count"]) for r in rows}
    assert ops.get("aten.addmm", 0) + ops.get("aten.mm", 0) == 3
    assert all(r["supported"] in ("yes", "no") for r in rows)


def test_custom_decompositions_are_used() -> None:
    calls = []

    def my_relu(x):
        calls.append(1)
        return torch.clamp_min(x, 0)

    cfg = _run_eagerly()
    backend = graphgear.get_backend(cfg, custom_decompositions={torch.ops.aten.relu.default: my_relu})
    f = torch.compile(lambda x: torch.relu(x) * 2, backend=backend)
    x = torch.randn(6)
    assert_close(f(x), torch.relu(x) * 2)
    assert calls
    assert not any(n.target is torch.ops.aten.relu.default for n in [])


def test_user_passes_run_in_order() -> None:
    order = []

    def pre(gm, example_inputs, config):
        order.append(("pre", len(gm.graph.nodes)))

    def post(gm, example_inputs, config):
        order.append(("post", len(gm.graph.nodes)))

    cfg = _run_eagerly()
    cfg.experimental_config.post_grad_custom_pre_pass = pre
    cfg.experimental_config.post_grad_custom_post_pass = post
    torch.compile(lambda x: x + 1, backend=graphgear.get_backend(cfg))(torch.randn(2))
    assert [o[0] for o in order] == ["pre", "post"]

"""The CPU passes of the static compile (``graphgear.cpu.passes``) run by the pass
manager: listed in the graph's stats record, switchable by name in
``experimental_config.disabled_passes``, dumped with ``debug.graph_dump``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphgear
import graphgear.cpu.kernels.small_gemm_kernel as small_gemm
import graphgear.cpu.kernels.small_linear_kernel as small_linear
from graphgear.cpu.passes import GroupFrozenProducts, PackFrozenLinears, PackFrozenSmall, RouteSmallLinear
from graphgear.passes import CPU_PASS_NAMES, check_disabled_passes, pass_names
from tests.helpers import assert_close, last_record, make_config, ops_compiled

pytestmark = pytest.mark.inductor


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 40, bias=False), nn.ReLU(),
                         nn.Linear(40, 8)).eval()


def test_cpu_pass_names_are_known_passes_in_the_order_they_run() -> None:
    """The passes carry the names ``pass_names()`` lists (so ``disabled_passes`` takes
    them), in the order the static compile runs them; ``decode_attention`` stays known."""
    classes = [GroupFrozenProducts, PackFrozenSmall, PackFrozenLinears, RouteSmallLinear]
    assert [c.name for c in classes] == list(CPU_PASS_NAMES)
    assert all(c.static_sizes for c in classes)
    names = pass_names()
    assert names[-len(CPU_PASS_NAMES):] == list(CPU_PASS_NAMES)
    assert "decode_attention" in names
    check_disabled_passes(make_config("reduce-overhead", disabled_passes=[*CPU_PASS_NAMES, "decode_attention"]))


def test_cpu_passes_are_in_the_stats_of_a_frozen_reduce_overhead_compile() -> None:
    """A small MLP with frozen weights compiled in reduce-overhead on the CPU: every CPU
    pass ran and is in its graph's stats record; its three products of 4 rows went to
    graphgear's packed product."""
    assert small_gemm.kernel() is not None, "graphgear's small-batch product did not build here"
    net = _mlp()
    f = torch.compile(net, backend=graphgear.get_backend(
        make_config("reduce-overhead", warmup_iters=0, frozen_parameter=True)))
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(4, 24)
            assert_close(f(x), net(x), reduction=40)
    rec = last_record()
    assert all(name in rec.passes for name in CPU_PASS_NAMES), rec.passes
    assert rec.passes["pack_frozen_small"] == 3, rec.passes
    assert any(name in g.passes for g in graphgear.stats().graphs for name in CPU_PASS_NAMES)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_disabling_the_routing_pass_keeps_atens_products_and_outputs_equal_eager(monkeypatch, mode) -> None:
    """``disabled_passes=["small_linear"]`` is accepted and turns the routing off: no
    ``graphgear::small_linear`` in the compiled graph (there are three without it), the
    pass is not in the stats record, and outputs equal eager's."""
    assert small_linear.kernel() is not None, "graphgear's row-major small-batch product did not build here"
    seen = ops_compiled(monkeypatch, torch.ops.graphgear.small_linear.default)
    net = _mlp()
    for disabled, want in [((), 3), (("small_linear",), 0)]:
        torch.compiler.reset()
        seen.clear()
        f = torch.compile(net, backend=graphgear.get_backend(
            make_config(mode, warmup_iters=0, disabled_passes=disabled)))
        with torch.no_grad():
            for _ in range(2):
                x = torch.randn(4, 24)
                assert_close(f(x), net(x), reduction=40, what=f"disabled {disabled}")
        assert seen == [(want,)], (disabled, seen)
        assert ("small_linear" in last_record().passes) == (not disabled), last_record().passes


@pytest.mark.parametrize("frozen", [False, True])
def test_graph_dump_writes_the_graph_after_a_cpu_pass_that_changed_it(tmp_path, frozen) -> None:
    """``debug.graph_dump``: a file after the CPU pass that rewrote the products
    (``small_linear`` on weights passed in, ``pack_frozen_small`` on frozen ones),
    holding the op it put in the graph."""
    assert small_gemm.kernel() is not None and small_linear.kernel() is not None
    cfg = make_config("reduce-overhead", warmup_iters=0, frozen_parameter=frozen)
    cfg.debug.graph_dump.type = "txt"
    cfg.debug.graph_dump.path = str(tmp_path)
    net = _mlp()
    f = torch.compile(net, backend=graphgear.get_backend(cfg))
    with torch.no_grad():
        x = torch.randn(4, 24)
        assert_close(f(x), net(x), reduction=40)
    name, op = ("pack_frozen_small", "packed_linear") if frozen else ("small_linear", "small_linear")
    dumps = sorted(tmp_path.glob(f"gg_*_after_{name}.txt"))
    assert dumps, sorted(p.name for p in tmp_path.iterdir())
    assert f"graphgear.{op}" in dumps[-1].read_text()

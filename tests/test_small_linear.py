"""graphgear's small-M product for weights that are not frozen (``kernels/small_linear``):
the kernel against ATen on odd shapes and thread counts, its misuse, its use in
max-autotune and plain reduce-overhead inference graphs (checked against eager, a
weight changed in place included), training graphs left alone, and what happens where
it cannot be built."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import graphgear
import graphgear.cpu.kernels.small_linear_kernel as small_linear
from graphgear.capture import CaptureEngine
from tests.helpers import assert_close, each_thread_count, make_config, ops_compiled, unbuildable_kernel

pytestmark = pytest.mark.inductor


def _built() -> None:
    assert small_linear.kernel() is not None, "graphgear's row-major small-batch product did not build here"


@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_aten_on_odd_shapes(bias: bool) -> None:
    """Row counts 1 to 17 (blocks of 4 rows and their rests), widths that are not whole
    groups of weight rows, depths that are not whole vectors (down to 1): ``x @ W.T +
    b`` as ATen computes it (to fp32 rounding: the summation order differs)."""
    _built()
    torch.manual_seed(0)
    for m in range(1, 18):
        for n, k in [(1, 1), (5, 3), (31, 64), (33, 257), (100, 17)]:
            x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
            got = small_linear.small_linear(x, w, b if bias else None)
            want = torch.nn.functional.linear(x, w, b if bias else None)
            assert_close(got, want, reduction=k, what=f"rows {m}, N {n}, K {k}")


def test_kernel_split_over_threads_equals_aten() -> None:
    """With more than one thread the weight rows are split between threads (counts that
    do not split evenly): the same result as ATen's."""
    _built()
    torch.manual_seed(0)
    for threads in each_thread_count(2, 3):
        for m, n, k in [(1, 2053, 128), (3, 1000, 64), (9, 2053, 128), (16, 97, 1024)]:
            x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
            assert_close(small_linear.small_linear(x, w, b), torch.nn.functional.linear(x, w, b),
                         reduction=k, what=f"{threads} threads, rows {m}, N {n}, K {k}")


def test_kernel_refuses_what_it_cannot_read() -> None:
    """A transposed weight, an ``out`` of the wrong shape, another dtype: a ValueError
    that names the shapes and what was expected, never a read past a tensor."""
    _built()
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"weight \(16, 8\).*contiguous"):
        small_linear.small_linear_out(x, torch.randn(8, 16).t(), None, out=torch.empty(4, 8))
    with pytest.raises(ValueError, match=r"out \(4, 9\)"):
        small_linear.small_linear_out(x, w, None, out=torch.empty(4, 9))
    with pytest.raises(ValueError, match="fp32"):
        small_linear.small_linear_out(x.double(), w.double(), None, out=torch.empty(4, 8, dtype=torch.float64))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 40, bias=False), nn.ReLU(),
                         nn.Linear(40, 8)).eval()


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
@pytest.mark.parametrize("rows", [2, 16, 17])
def test_unfrozen_products_of_2_to_16_rows_are_graphgears_and_see_weight_updates(monkeypatch, mode, rows) -> None:
    """Without ``frozen_parameter`` (weights are inputs of the graph) products of 2 to
    16 rows go to graphgear's row-major product, with and without bias, past that they
    stay Inductor's. The weight is read on every call: one changed in place is seen.
    In reduce-overhead the CPU graph replays the built kernel itself."""
    _built()
    seen = ops_compiled(monkeypatch, torch.ops.graphgear.small_linear.default)
    net = _mlp()
    f = torch.compile(net, backend=graphgear.get_backend(make_config(mode, warmup_iters=0)))
    with torch.no_grad():
        for step in range(4):
            if step == 2:
                net[2].weight.mul_(-0.5)
                net[0].bias.add_(1.0)
            x = torch.randn(rows, 24)
            assert_close(f(x), net(x), reduction=40, what=f"step {step}")
    assert seen == [(3 if rows <= 16 else 0,)], seen
    if mode == "reduce-overhead" and rows <= 16:
        graphs = [e.graph for o in gc.get_objects() if type(o) is CaptureEngine
                  for e in o.entries.values() if e.graph is not None and e.graph.program is not None]
        fns = [c[0] for g in graphs for c in g.program.calls]
        assert fns.count(small_linear.kernel()) == 3, fns


def _wide() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 2100), nn.ReLU(), nn.Linear(2100, 8, bias=False), nn.ReLU(),
                         nn.Linear(8, 16)).eval()


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_one_row_products_too_wide_for_inductors_decomposition_are_graphgears(monkeypatch, mode) -> None:
    """At one row, products whose weight has a side over 2048 (Inductor's one-row
    decomposition leaves them to ATen's ``sgemv``) go to graphgear's product; a narrow
    one stays Inductor's fused loops. Results equal eager's, a weight changed in place
    included."""
    _built()
    seen = ops_compiled(monkeypatch, torch.ops.graphgear.small_linear.default)
    net = _wide()
    f = torch.compile(net, backend=graphgear.get_backend(make_config(mode, warmup_iters=0)))
    with torch.no_grad():
        for step in range(4):
            if step == 2:
                net[0].weight.mul_(-0.5)
                net[2].weight.add_(0.01)
            x = torch.randn(1, 16)
            assert_close(f(x), net(x), reduction=2100, what=f"step {step}")
    assert seen == [(2,)], seen


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_training_graphs_keep_atens_products_and_gradients_equal_eager(monkeypatch, mode) -> None:
    """The op has no backward of its own: forward and backward graphs are left as they
    are, and gradients equal eager's."""
    seen = ops_compiled(monkeypatch, torch.ops.graphgear.small_linear.default)
    net, ref = _mlp().train(), _mlp().train()
    f = torch.compile(net, backend=graphgear.get_backend(make_config(mode, warmup_iters=0)))
    for _ in range(2):
        x = torch.randn(4, 24)
        f(x).square().sum().backward()
        ref(x).square().sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, reduction=40)
    assert all(s == (0,) for s in seen), seen


def test_where_the_kernel_cannot_be_built_atens_products_serve_and_the_reason_is_logged(monkeypatch, caplog) -> None:
    """No C++ compiler (the build raises): a warning says why and what runs instead; no
    product is rewritten and results equal eager's."""
    assert "stay ATen's" in unbuildable_kernel(monkeypatch, caplog, small_linear.kernel)
    monkeypatch.setattr(small_linear, "kernel", lambda: None)
    seen = ops_compiled(monkeypatch, torch.ops.graphgear.small_linear.default)
    net = _mlp()
    f = torch.compile(net, backend=graphgear.get_backend(make_config("reduce-overhead", warmup_iters=0)))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 24)
            assert_close(f(x), net(x), reduction=40)
    assert seen == [(0,)], seen

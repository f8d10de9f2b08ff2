"""graphgear's small-batch matrix product (``kernels/small_gemm``): the kernel against
ATen on odd shapes, its misuse, its use in served graphs (checked against eager: outputs
and the KV cache), the row range it takes, and what happens where it cannot be built."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import graphgear
import graphgear.cpu.kernels.small_gemm_kernel as small_gemm
from graphgear.capture import CaptureEngine
from tests.helpers import assert_close, each_thread_count, make_config, ops_compiled, unbuildable_kernel
from tests.helpers import make_backend as _ro
from tests.models import hf_qwen2_pair

pytestmark = pytest.mark.inductor


def _built() -> None:
    assert small_gemm.kernel() is not None, "graphgear's small-batch product did not build here"


@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_aten_on_odd_shapes(bias: bool) -> None:
    """Every row count from 1 to 17 (the row blocks of 8 and their rests), widths that
    are not whole panels of 32 and depths down to 1: ``x @ W.T + b`` as ATen computes it
    (to fp32 rounding: the summation order differs)."""
    _built()
    torch.manual_seed(0)
    for m in range(1, 18):
        for n, k in [(1, 1), (31, 3), (32, 64), (33, 257), (100, 17)]:
            x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
            got = small_gemm.packed_linear(x, small_gemm.pack_weight(w),
                                           small_gemm.pack_bias(b) if bias else None, n)
            want = torch.nn.functional.linear(x, w, b if bias else None)
            assert_close(got, want, reduction=k, what=f"rows {m}, N {n}, K {k}")


def test_kernel_split_over_threads_equals_aten() -> None:
    """With more than one thread the panels are split between threads (widths that do
    not split evenly, rows past one block): the same result as ATen's."""
    _built()
    torch.manual_seed(0)
    for threads in each_thread_count(2, 3):
        for m, n, k in [(3, 1000, 64), (9, 33 * 32 + 5, 128), (16, 96, 512)]:
            x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
            got = small_gemm.packed_linear(x, small_gemm.pack_weight(w), small_gemm.pack_bias(b), n)
            assert_close(got, torch.nn.functional.linear(x, w, b), reduction=k,
                         what=f"{threads} threads, rows {m}, N {n}, K {k}")


def test_kernel_refuses_a_weight_it_did_not_pack() -> None:
    """A plain ``[N, K]`` weight (not packed) or a transposed ``x``: a ValueError that
    names the shapes and what was expected, never a read past the weight."""
    _built()
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"packed weight \(8, 16\).*pack_weight"):
        small_gemm.packed_linear_out(x, w, None, out=torch.empty(4, 8))
    with pytest.raises(ValueError, match="contiguous"):
        small_gemm.packed_linear_out(torch.randn(16, 4).t(), small_gemm.pack_weight(w), None,
                                     out=torch.empty(4, 8))
    with pytest.raises(ValueError, match="out"):
        small_gemm.packed_linear_out(x, small_gemm.pack_weight(w), None, out=torch.empty(4, 40))


def _products(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """Per static compile: (graphgear products, MKL products) in the graph Inductor gets."""
    return ops_compiled(monkeypatch, torch.ops.graphgear.packed_linear.default, torch.ops.mkl._mkl_linear.default)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 40, bias=False), nn.ReLU(),
                         nn.Linear(40, 8)).eval()


class _QKVBlock(nn.Module):
    """Three products of the same rows (grouped for packing) and one of their output."""

    def __init__(self, out: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(64, 32)
        self.out = nn.Linear(128, out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.cat([self.q(x), self.k(x), self.v(x)], -1).relu())


@pytest.mark.parametrize("rows", [2, 16, 17])
def test_served_products_of_2_to_16_rows_are_graphgears_and_replay_as_kernel_calls(monkeypatch, rows) -> None:
    """Frozen products of 2 to 16 rows go to graphgear's product (with and without
    bias), past that to MKL's. At 2 and 16 rows the graph stays straight-line code: the
    CPU graph replays it as kernel calls, graphgear's product among them as the built
    kernel itself. Results equal eager's at every step."""
    _built()
    if not torch.backends.mkl.is_available():
        pytest.skip("this torch has no MKL")
    seen = _products(monkeypatch)
    net = _mlp()
    f = graphgear.inference.serve(net, make_config("reduce-overhead", warmup_iters=0))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(rows, 24)
            assert_close(f(x), net(x), reduction=40)
    assert seen == [(3, 0)] if rows <= 16 else [(0, 3)], seen
    if rows <= 16:
        graphs = [e.graph for o in gc.get_objects() if type(o) is CaptureEngine
                  for e in o.entries.values() if e.graph is not None and e.graph.program is not None]
        fns = [c[0] for g in graphs for c in g.program.calls]
        assert fns.count(small_gemm.kernel()) == 3, fns


def test_one_row_products_too_wide_for_inductors_decomposition_are_graphgears_unpacked(monkeypatch) -> None:
    """At one row, a product whose frozen weight is wider than Inductor's one-row
    decomposition takes (it would stay ATen's ``sgemv``) goes to graphgear's row-major
    product on the frozen weight itself: no packed copy is made. The narrow one stays
    Inductor's fused loop. Results equal eager's at every step."""
    _built()
    from graphgear._torch.inductor_passes import inductor_one_row_decompose_limit

    wide = inductor_one_row_decompose_limit() + 5  # not a whole panel of 32 either
    seen = ops_compiled(monkeypatch, torch.ops.graphgear.packed_linear.default, torch.ops.mkl._mkl_linear.default,
                        torch.ops.graphgear.small_linear.default)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, wide), nn.ReLU(),
                        nn.Linear(wide, 8, bias=False)).eval()
    f = graphgear.inference.serve(net, make_config("reduce-overhead", warmup_iters=0))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(1, 24)
            assert_close(f(x), net(x), reduction=wide)
    assert seen == [(0, 0, 2)], seen


def test_without_the_kernel_wide_one_row_products_stay_atens(monkeypatch) -> None:
    """Where graphgear's row-major product cannot be built, the wide one-row products
    stay ATen's (nothing rewritten, nothing packed), a batch of 0 rows runs too, and
    results equal eager's."""
    from graphgear._torch.inductor_passes import inductor_one_row_decompose_limit
    from graphgear.cpu.kernels import small_linear_kernel as small_linear

    monkeypatch.setattr(small_linear, "kernel", lambda: None)
    wide = inductor_one_row_decompose_limit() + 5
    seen = ops_compiled(monkeypatch, torch.ops.graphgear.packed_linear.default, torch.ops.mkl._mkl_linear.default,
                        torch.ops.graphgear.small_linear.default)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(24, wide), nn.ReLU(), nn.Linear(wide, 8)).eval()
    f = graphgear.inference.serve(net, make_config("reduce-overhead", warmup_iters=0))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(1, 24)
            assert_close(f(x), net(x), reduction=wide)
        assert f(torch.randn(0, 24)).shape == (0, 8)
    assert seen and all(s == (0, 0, 0) for s in seen), seen


def test_served_batch_sizes_share_one_packed_copy_of_each_weight() -> None:
    """Every batch size (gear) of a served model packs the same frozen weights: the copies
    (packed weights, concatenated q/k/v-like groups) are made once per backend and held
    by every gear's code, not once per gear; results equal eager's at each."""
    _built()
    torch.manual_seed(0)

    net = _QKVBlock(64).eval()
    backend = graphgear.get_backend(make_config("reduce-overhead", warmup_iters=0, frozen_parameter=True))
    f = torch.compile(net, backend=backend)
    held = []
    with torch.no_grad():
        for rows in (2, 4, 8, 3):
            x = torch.randn(rows, 64)
            assert_close(f(x), net(x), reduction=128, what=f"{rows} rows")
            held.append((len(backend._frozen_copies), backend._frozen_copies.nbytes()))
    # q/k/v grouped: their concatenation packed (the concatenation itself dropped once
    # packed), the output weight packed, the concatenated bias packed
    assert held[0][0] >= 2 and held[0][1] > 0, held
    assert all(h == held[0] for h in held), held


@pytest.mark.parametrize("rows", [2, 8, 16, 17])
def test_frozen_weights_past_the_cache_stream_as_they_lie_with_no_copy(monkeypatch, rows) -> None:
    """Where a frozen graph's small-M products read more weight bytes than the CPU's
    last-level cache holds (here: a cache of 1 KiB), their 2 to 16 rows go to
    graphgear's row-major product on the frozen weights themselves: nothing grouped,
    nothing packed, no copy held. Past 16 rows MKL's packing takes them as before.
    Results equal eager's at every step."""
    import graphgear.cpu.passes.pack_frozen as mkl_pack
    from graphgear.cpu.kernels import small_linear_kernel as small_linear

    assert small_linear.kernel() is not None, "graphgear's row-major product did not build here"
    if not torch.backends.mkl.is_available():
        pytest.skip("this torch has no MKL")
    monkeypatch.setattr(mkl_pack, "last_level_cache_bytes", lambda: 1024)
    seen = ops_compiled(monkeypatch, torch.ops.graphgear.packed_linear.default, torch.ops.mkl._mkl_linear.default,
                        torch.ops.graphgear.small_linear.default)
    torch.manual_seed(0)

    net = _QKVBlock(24).eval()
    backend = graphgear.get_backend(make_config("reduce-overhead", warmup_iters=0, frozen_parameter=True))
    f = torch.compile(net, backend=backend)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(rows, 64)
            assert_close(f(x), net(x), reduction=128, what=f"{rows} rows")
    if rows <= 16:
        assert seen == [(0, 0, 4)], seen
        assert backend._frozen_copies.nbytes() == 0, len(backend._frozen_copies)
    else:  # q/k/v grouped into one MKL product, the output's its own
        assert seen == [(0, 2, 0)], seen
        assert backend._frozen_copies.nbytes() > 0


def test_a_copied_backend_serves_with_a_store_of_its_own() -> None:
    """transformers deep-copies its ``CompileConfig``, a backend object included, before
    ``torch.compile``: a backend copies (the store of frozen copies is a cache, so the
    copy starts an empty one) and the copy compiles and serves right."""
    import copy

    _built()
    torch.manual_seed(0)
    net = _mlp()
    backend = graphgear.get_backend(make_config("reduce-overhead", warmup_iters=0, frozen_parameter=True))
    twin = copy.deepcopy(backend)
    assert twin._frozen_copies is not backend._frozen_copies and len(twin._frozen_copies) == 0
    f = torch.compile(net, backend=twin)
    with torch.no_grad():
        x = torch.randn(4, 24)
        assert_close(f(x), net(x), reduction=40)
    assert len(twin._frozen_copies) > 0 and len(backend._frozen_copies) == 0


def test_frozen_copies_live_as_long_as_a_gear_holds_them() -> None:
    """The store holds copies weakly: a copy no compiled code holds is made again; a
    copy of a copy is found again by how it was made, though made anew."""
    from graphgear.cpu.frozen import FrozenCopies

    copies, w, made = FrozenCopies(), torch.randn(8, 4), []

    def pack() -> torch.Tensor:
        made.append(1)
        return w * 2

    a = copies.get("double", [w], pack)
    assert copies.get("double", [w], pack) is a and len(made) == 1
    twice = copies.get("again", [a], lambda a=a: a * 2)
    del a
    assert len(copies) == 1  # "double" died; "again" lives
    a2 = copies.get("double", [w], pack)
    assert len(made) == 2
    assert copies.get("again", [a2], lambda: a2 * 3) is twice  # same recipe: found again
    assert torch.equal(twice, w * 4)


def test_where_the_kernel_cannot_be_built_mkl_serves_and_the_reason_is_logged(monkeypatch, caplog) -> None:
    """No C++ compiler (the build raises): a warning says why and what serves instead,
    the frozen products go to MKL, and results equal eager's."""
    assert "MKL's packed GEMM instead" in unbuildable_kernel(monkeypatch, caplog, small_gemm.kernel)
    if not torch.backends.mkl.is_available():
        return
    monkeypatch.setattr(small_gemm, "kernel", lambda: None)
    seen = _products(monkeypatch)
    net = _mlp()
    f = graphgear.inference.serve(net, make_config("reduce-overhead", warmup_iters=0))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 24)
            assert_close(f(x), net(x), reduction=40)
    assert seen == [(0, 3)], seen


def test_unfrozen_products_are_left_to_inductor(monkeypatch) -> None:
    """Without ``frozen_parameter`` a weight may change between calls: no packing (the
    products go to graphgear's row-major product instead: ``test_small_linear``)."""
    seen = _products(monkeypatch)
    net = _mlp()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    with torch.no_grad():
        x = torch.randn(4, 24)
        assert_close(f(x), net(x), reduction=40)
    assert seen == [(0, 0)], seen


@pytest.mark.slow
@torch.no_grad()
@pytest.mark.parametrize(("batch", "streamed"), [(4, False), (1, False), (4, True)])
def test_served_transformers_decoder_equals_eager_with_graphgears_products(monkeypatch, batch: int,
                                                                         streamed: bool) -> None:
    """A served transformers Qwen2 (grouped-query attention, biased q/k/v projections)
    at batch 4, and at batch 1 with a vocabulary too wide for Inductor's one-row
    decomposition: its products are graphgear's (at batch 1 the vocabulary's, by the
    row-major product on the frozen weight, unpacked), its step replays as kernel calls,
    and logits and the KV cache equal eager's at every step. ``streamed``: its weights
    outgrow the last-level cache (patched to 1 KiB), so at batch 4 they are read
    unpacked by the row-major product too."""
    _built()
    from transformers import StaticCache

    import graphgear.cpu.passes.pack_frozen as mkl_pack
    from graphgear._torch.inductor_passes import inductor_one_row_decompose_limit
    from graphgear.cpu.kernels import small_linear_kernel as small_linear

    if streamed:
        monkeypatch.setattr(mkl_pack, "last_level_cache_bytes", lambda: 1024)

    seen = ops_compiled(monkeypatch, torch.ops.graphgear.packed_linear.default, torch.ops.mkl._mkl_linear.default,
                        torch.ops.graphgear.small_linear.default)
    wide_vocab = {} if batch > 1 else {"vocab_size": inductor_one_row_decompose_limit() + 40}
    cfg, model, ref = hf_qwen2_pair(**wide_vocab)
    f = graphgear.inference.serve(model)
    cache, ref_cache = StaticCache(config=cfg, max_cache_len=16), StaticCache(config=cfg, max_cache_len=16)
    tok = ref_tok = torch.randint(3, 100, (batch, 1), generator=torch.Generator().manual_seed(0))
    for p in range(6):
        pos = torch.full((batch, 1), p)
        out = f(input_ids=tok, cache=cache, position_ids=pos, use_cache=True).logits
        want = ref(input_ids=ref_tok, cache=ref_cache, position_ids=pos, use_cache=True).logits
        assert_close(out, want, reduction=128)
        for layer, ref_layer in zip(cache.layers, ref_cache.layers):
            assert_close(layer.keys, ref_layer.keys, reduction=64, what="keys")
            assert_close(layer.values, ref_layer.values, reduction=64, what="values")
        tok, ref_tok = out[:, -1:].argmax(-1), want[:, -1:].argmax(-1)
    packed, mkl, row_major = seen[-1]
    packs = batch > 1 and not streamed
    assert (packed > 0, mkl, row_major > 0) == (packs, 0, not packs), seen
    graphs = [e.graph for o in gc.get_objects() if type(o) is CaptureEngine
              for e in o.entries.values() if e.graph is not None and e.graph.program is not None]
    want = small_gemm.kernel() if packs else small_linear.kernel()
    assert any(c[0] is want for g in graphs for c in g.program.calls)


def test_served_gears_with_padding_run_graphgears_products_on_the_padded_rows(monkeypatch) -> None:
    """Gears [2, 4, 8] with padding, served: batches 3, 5, 7 run the gear above them
    (rows past the batch are padding), each gear's graph has graphgear's products, and
    every output equals eager's; a batch above the largest gear is refused, as before."""
    _built()
    if not torch.backends.mkl.is_available():
        pytest.skip("this torch has no MKL")
    seen = _products(monkeypatch)
    net = _mlp()
    f = graphgear.inference.serve(net, make_config("reduce-overhead", warmup_iters=0, gear_padding=True))
    with torch.no_grad():
        for n in [3, 8, 5, 2, 7, 3]:
            x = torch.randn(n, 24)
            graphgear.set_dim_gears(x, {0: [2, 4, 8]})
            out = f(x)
            assert out.shape == (n, 8)
            assert_close(out, net(x), reduction=40, what=f"batch {n}")
        x = torch.randn(9, 24)
        graphgear.set_dim_gears(x, {0: [2, 4, 8]})
        with pytest.raises(graphgear.GearError, match="above the largest gear"):
            f(x)
    assert seen == [(3, 0)] * 3, seen


@pytest.mark.slow
@torch.no_grad()
def test_served_decoder_that_saw_two_batch_sizes_replays_kernel_calls_at_both(monkeypatch) -> None:
    """A server sees batch 1, then batch 2: dynamo compiles the second with a dynamic
    batch (automatic dynamic shapes), and graphgear specialises it per size. The passes
    that decide by static sizes (the one-query attention written out) run again on the
    specialised graph, so batch 2 is straight-line code too (kernel calls, graphgear's
    products), not the flash kernel through the generated code. Logits and the KV cache
    equal eager's."""
    _built()
    from transformers import StaticCache

    cfg, model, ref = hf_qwen2_pair()
    f = graphgear.inference.serve(model)
    for batch in (1, 2):
        cache, ref_cache = StaticCache(config=cfg, max_cache_len=16), StaticCache(config=cfg, max_cache_len=16)
        tok = ref_tok = torch.randint(3, 100, (batch, 1), generator=torch.Generator().manual_seed(batch))
        for p in range(4):
            pos = torch.full((batch, 1), p)
            out = f(input_ids=tok, cache=cache, position_ids=pos, use_cache=True).logits
            want = ref(input_ids=ref_tok, cache=ref_cache, position_ids=pos, use_cache=True).logits
            assert_close(out, want, reduction=128)
            assert_close(cache.layers[1].keys, ref_cache.layers[1].keys, reduction=64, what="keys")
            tok, ref_tok = out[:, -1:].argmax(-1), want[:, -1:].argmax(-1)
    last = graphgear.stats().graphs[-1]
    assert last.passes.get("decode_attention", 0) > 0, last.passes
    graphs = [e.graph for o in gc.get_objects() if type(o) is CaptureEngine and o.record is last
              for e in o.entries.values() if e.graph is not None]
    assert graphs and all(g.program is not None for g in graphs), "batch 2 should replay as kernel calls"
    assert any(c[0] is small_gemm.kernel() for g in graphs for c in g.program.calls)

"""Probes of issue 8, one test (or more) per numbered item, each of which failed before
its fix: reduce-overhead is never silently wrong, never touches freed memory, serves
threads, and keeps inputs mutated exactly once; passes, gears and files behave."""

from __future__ import annotations

import gc
import logging
import os
import re
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import fx, nn

import graphgear
from graphgear import GearError
from graphgear.capture import MemoryPool, liveness
from graphgear.capture.cpu_graph import CPUGraph
from tests.helpers import assert_close, make_backend, make_config, run_threads, tolerance
from tests.helpers import last_record as _rec
from tests.helpers import make_backend as _ro
from tests.models import CacheWriter, Net

aten = torch.ops.aten

pytestmark = pytest.mark.inductor


# ---- reduce-overhead: memory safety, threads, capture rules (items 1-5, 7, 9-11, 16a, 18) ----


class AddCache(nn.Module):
    """Adds its input into a cache in place (the kind of mutation a double run shows)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.add_(self.lin(x))
        return cache * 2


_VIEWS = {
    "slice": lambda t: t[:, -1],
    "narrow": lambda t: t.narrow(1, 2, 3),
    "view": lambda t: t.view(-1),
    "t": lambda t: t.t(),
    "select": lambda t: t[0],
}


@pytest.mark.parametrize("make_view", list(_VIEWS.values()), ids=list(_VIEWS))
def test_item1_views_made_under_inference_mode_raise_when_stale(make_view) -> None:  # type: ignore[no-untyped-def]
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    with torch.inference_mode():
        out = f(x1)
        view = make_view(out)
        want = make_view(net(x1)).clone()
        assert_close(view, want, reduction=64)
        out = f(x2)  # the only reference to the first output is now the view
        with pytest.raises(RuntimeError, match="overwritten.*clone_output=True"):
            view + 0
        assert_close(out, net(x2), reduction=64)


def test_item1_frozen_packed_outputs_go_stale_like_any_other() -> None:
    """frozen_parameter at 4 rows: the output comes straight from the C++ GEMM template's
    product on packed weights; a view of it made under inference_mode goes stale like any
    output."""
    net = nn.Linear(8, 8)
    f = torch.compile(net, backend=_ro(warmup_iters=0, frozen_parameter=True))
    x1, x2 = torch.randn(4, 8), torch.randn(4, 8)
    with torch.inference_mode():
        view = f(x1)[1:]
        assert_close(view, net(x1)[1:], reduction=64)
        out = f(x2)
        with pytest.raises(RuntimeError, match="overwritten.*clone_output=True"):
            view + 0
        assert_close(out, net(x2), reduction=64)
        assert_close(f(x1), net(x1), reduction=64)


def _spy_static_compiles(monkeypatch: pytest.MonkeyPatch, note: Any) -> list[Any]:
    """Record ``note(graph module, keywords)`` for every Inductor compile of a static
    graph (``compilers.inductor.compile_static``), in order."""
    import graphgear.compilers.inductor as gi

    seen: list[Any] = []
    real = gi.inductor_compile_fx_inner

    def spy(gm: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(note(gm, kwargs))
        return real(gm, *args, **kwargs)

    monkeypatch.setattr(gi, "inductor_compile_fx_inner", spy)
    return seen


class _FourLinears(nn.Module):
    """Four products and a state buffer written in place each call (a KV cache's role)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8)
        self.register_buffer("state", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.d(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))
        self.state.add_(out.sum(0))
        return out


def _small_gemm(monkeypatch, on: bool) -> None:
    """graphgear's small-batch product on (the kernel must build here), or off (frozen
    products of 2 to 16 rows go to MKL and, four or more, Inductor's C++ wrapper)."""
    import graphgear.cpu.kernels.small_gemm_kernel as small_gemm

    if on:
        assert small_gemm.kernel() is not None, "graphgear's small-batch product did not build"
    else:
        monkeypatch.setattr(small_gemm, "MAX_ROWS", 1)


@pytest.mark.parametrize("product", ["mkl", "graphgear"])
@pytest.mark.parametrize("rows", [1, 4])
def test_item1_frozen_cpp_wrapper_outputs_state_and_staleness_like_the_python_wrapper(monkeypatch, rows,
                                                                                       product) -> None:
    """frozen_parameter at 4 rows with MKL's products: four packed products, so the CPU
    graph's code is Inductor's C++ wrapper (allocating in C++; outputs copied to static
    buffers); with graphgear's own product, or at one row, the Python wrapper with its
    allocation record. Every way: outputs and the in-place state equal eager's at every
    call, and a view made under inference_mode goes stale when the next replay
    overwrites its output."""
    from graphgear.cpu.passes.pack_frozen import mkl_packing_available

    if not mkl_packing_available():
        pytest.skip("this torch has no MKL")
    _small_gemm(monkeypatch, product == "graphgear")
    used = _spy_static_compiles(monkeypatch, lambda gm, kwargs: bool(kwargs.get("cpp_wrapper")))
    torch.manual_seed(0)
    net = _FourLinears()
    ref = _FourLinears()
    ref.load_state_dict(net.state_dict())
    f = torch.compile(net, backend=_ro(warmup_iters=0, frozen_parameter=True))
    xs = [torch.randn(rows, 8) for _ in range(4)]
    with torch.inference_mode():
        view = f(xs[0])[-1:]
        assert_close(view, ref(xs[0])[-1:], reduction=64)
        for x in xs[1:]:
            assert_close(f(x), ref(x), reduction=64)
            assert_close(net.state, ref.state, reduction=64)
        with pytest.raises(RuntimeError, match="overwritten.*clone_output=True"):
            view + 0
    assert used == [rows > 1 and product == "mkl"]
    assert _rec().replays == 3


@pytest.mark.parametrize("product", ["mkl", "graphgear"])
def test_item5_threads_replaying_cpp_wrapper_graphs_get_their_own_results(monkeypatch, product) -> None:
    """Served (frozen) graphs of four MKL products at 2 to 4 rows are Inductor's C++
    wrapper, which allocates in C++ and whose outputs the CPU graph copies; with
    graphgear's own product they are kernel calls on recorded buffers: either way four
    threads starting cold together, each with its own rows, get their own results at
    every step."""
    from graphgear.cpu.passes.pack_frozen import mkl_packing_available

    if not mkl_packing_available():
        pytest.skip("this torch has no MKL")
    _small_gemm(monkeypatch, product == "graphgear")
    used = _spy_static_compiles(monkeypatch, lambda gm, kwargs: bool(kwargs.get("cpp_wrapper")))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16),
                        nn.ReLU(), nn.Linear(16, 8)).eval()
    f = graphgear.inference.serve(net, make_config("reduce-overhead", warmup_iters=0))
    inputs = [torch.randn(n, 8) + i for i, n in enumerate([2, 3, 4, 4])]
    with torch.no_grad():
        wants = [net(x) for x in inputs]
    _each_thread_gets_its_own(f, inputs, wants, steps=6, mode=torch.inference_mode)
    assert used and all(used) == (product == "mkl") and any(used) == (product == "mkl"), used


def test_frozen_one_row_products_too_wide_to_fuse_stay_aten_products_and_equal_eager(monkeypatch) -> None:
    """At one row Inductor fuses a frozen product into loops unless a side of its weight
    is past its decomposition limit (2048); those stay ATen products: not MKL-packed and
    not Inductor's C++ GEMM template (both slower at one row on the large bench model), so
    the template's autotuning is not switched on for them. Results equal eager's."""
    import torch._inductor.config as inductor_config

    seen = _spy_static_compiles(monkeypatch, lambda gm, kwargs: (
        len(gm.graph.find_nodes(op="call_function", target=torch.ops.mkl._mkl_linear.default)),
        bool(inductor_config.max_autotune)))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2304), nn.ReLU(), nn.Linear(2304, 8)).eval()
    f = graphgear.inference.serve(net, make_config("reduce-overhead", warmup_iters=0))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(1, 16)
            assert_close(f(x), net(x), reduction=2304)
    assert seen == [(0, False)]


def test_item1_decode_loop_keeps_last_logits_view() -> None:
    from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder

    cfg = DecoderConfig(vocab_size=64, hidden_size=32, num_layers=1, intermediate_size=64, max_seq_len=16)
    model, ref = ToyDecoder(cfg).eval(), ToyDecoder(cfg).eval()
    ref.load_state_dict(model.state_dict())
    f = torch.compile(model, backend=_ro(warmup_iters=0))
    with torch.inference_mode():
        tok = ref_tok = torch.tensor([[1]])
        lasts = []
        for p in range(6):
            last = f(tok, torch.tensor([p]))[:, -1]  # the view outlives the output
            want = ref(ref_tok, torch.tensor([p]))[:, -1]
            assert_close(last, want, reduction=64)
            tok, ref_tok = last.argmax(-1, keepdim=True), want.argmax(-1, keepdim=True)
            lasts.append(last)
        for stale in lasts[:-1]:
            with pytest.raises(RuntimeError, match="overwritten"):
                stale.sum()


def _churn(nbytes: int) -> list[torch.Tensor]:
    """Allocate (and fill) what freed memory of about ``nbytes`` would be reused for."""
    return [torch.full((nbytes // 4 + k,), 7.0) for k in range(64)]


def test_item2_reset_keeps_memory_behind_views_and_arrays() -> None:
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    x = torch.randn(2, 8)
    with torch.inference_mode():
        out = f(x)
        view = out[1]
        arr = out.numpy()
        want = arr.copy()
    del out
    graphgear.reset()
    gc.collect()
    junk = _churn(arr.nbytes)
    with pytest.raises(RuntimeError, match="released|overwritten"):
        view + 0
    np.testing.assert_array_equal(arr, want)  # valid memory, the values it had
    arr[:] = 1.0  # writing is safe too (no heap corruption)
    assert all(bool((j == 7.0).all()) for j in junk)
    del arr
    gc.collect()
    liveness.KEEPER.sweep()


def test_item2_pool_growth_keeps_memory_behind_earlier_outputs() -> None:
    net = Net()
    config = graphgear.CompilerConfig()
    config.mode = "reduce-overhead"
    config.capture_config.warmup_iters = 0
    f = torch.compile(net, backend=graphgear.get_backend(config))
    small, big = torch.randn(2, 8), torch.randn(64, 8)
    graphgear.set_dim_gears(small, {0: [2, 64]})
    graphgear.set_dim_gears(big, {0: [2, 64]})
    with torch.inference_mode():
        out = f(small)
        view, arr = out[0], out.numpy()
        want = arr.copy()
        out_big = f(big)  # a capture at the larger gear grows the pool's blocks
    junk = _churn(arr.nbytes)
    with pytest.raises(RuntimeError, match="overwritten"):
        view + 0
    np.testing.assert_array_equal(arr, want)
    arr[:] = 0.0
    assert all(bool((j == 7.0).all()) for j in junk)
    assert_close(out_big, net(big), reduction=64)
    assert len(graphgear.stats().graphs) == 1  # one FX graph, one pool: it grew


def test_item3_without_liveness_support_outputs_are_cloned_with_a_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(liveness, "poisoner", lambda: None)
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    with torch.inference_mode():
        with pytest.warns(UserWarning, match="returns copies"):
            out1 = f(x1)
        view = out1[:, -1]
        out2 = f(x2)
        assert_close(out1, net(x1), reduction=64)  # still its own values: a copy
        assert_close(view, net(x1)[:, -1], reduction=64)
        assert_close(out2, net(x2), reduction=64)
    assert _rec().captures == 1


def test_item3_build_without_a_compiler_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="graphgear.capture.liveness"):
        assert liveness.build_extension(tmp_path / "ext", timeout=120) is None
    assert "could not build" in caplog.text and "clones its outputs" in caplog.text


def test_item3_build_in_an_unwritable_folder_falls_back(tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="graphgear.capture.liveness"):
        assert liveness.build_extension(blocker / "ext", timeout=60) is None
    assert "could not build" in caplog.text


def test_item4_stale_build_lock_times_out_and_names_the_folder(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "ext"
    folder.mkdir(mode=0o700)
    (folder / "lock").write_text("")  # what a build killed half-way leaves behind
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="graphgear.capture.liveness"):
        assert liveness.build_extension(folder, timeout=8) is None
    assert time.perf_counter() - t0 < 60
    assert "stale build lock" in caplog.text and f"Delete the folder {folder}" in caplog.text


class PadNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + x


_THREAD_MODES = {
    "reduce-overhead": {},
    "reduce-overhead-clone": {"clone_output": True},
    "max-autotune": {"mode": "max-autotune"},
    "run_eagerly": {"run_eagerly": True},
}


def _each_thread_gets_its_own(f: Any, inputs: list[torch.Tensor], wants: list[torch.Tensor], *,
                              steps: int, mode: Any, label: str = "") -> None:
    """One thread per input, started together (a barrier), each calling ``f`` on its
    own input ``steps`` times under ``mode()``: every result equals its ``wants``, no
    thread raises or hangs."""
    errors: list[str] = []
    barrier = threading.Barrier(len(inputs))

    def worker(k: int) -> None:
        x, want = inputs[k], wants[k]
        try:
            barrier.wait()
            with mode():
                for step in range(steps):
                    out = f(x)
                    if out.shape != want.shape or not torch.allclose(out, want, atol=1e-5, rtol=1e-4):
                        errors.append(f"{label}thread {k} step {step}: wrong result")
                        return
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{label}thread {k}: {type(e).__name__}: {e}\n{traceback.format_exc()}")

    run_threads(worker, len(inputs))
    assert not errors, errors[:4]


@pytest.mark.parametrize("padding", [False, True], ids=["plain", "padding"])
@pytest.mark.parametrize("opts", list(_THREAD_MODES.values()), ids=list(_THREAD_MODES))
def test_item5_threads_each_get_their_own_results(opts: dict, padding: bool) -> None:
    torch.manual_seed(0)
    net = PadNet().eval()
    f = torch.compile(net, backend=_ro(gear_padding=padding, **opts))
    sizes = [3, 3, 5, 6] if padding else [4, 4, 4, 4]  # padded threads share a gear
    inputs = [torch.randn(n, 8) + i for i, n in enumerate(sizes)]
    for x in inputs:
        graphgear.set_dim_gears(x, {0: [2, 4, 8]})
    with torch.no_grad():
        wants = [net(x) for x in inputs]
        # Every graph key is built on one thread first (steady state; the test below
        # starts cold). Each thread still captures its own.
        for x in inputs:
            f(x)
            f(x)
    _each_thread_gets_its_own(f, inputs, wants, steps=300, mode=torch.no_grad)
    if opts.get("mode") is None and not opts.get("run_eagerly"):
        assert _rec().captures >= 1 + 4  # the main thread's, then one of its own per thread


_COLD_MODES = {
    "reduce-overhead": {},
    "serve": {"serve": True},
    "max-autotune-gears": {"mode": "max-autotune"},
}


def _threads_compiling_round(r: int, opts: dict, serve: bool, start: str) -> None:
    """One round of the test below: a fresh compiled model, four threads at once."""
    graphgear.reset()
    torch.manual_seed(r)
    net = PadNet().eval()
    f = (graphgear.inference.serve(net, make_config("reduce-overhead", **opts)) if serve
         else torch.compile(net, backend=_ro(**opts)))
    sizes = [4, 2, 8, 6]
    inputs = [torch.randn(n, 8) + i for i, n in enumerate(sizes)]
    for x in inputs:
        graphgear.set_dim_gears(x, {0: [2, 4, 6, 8]})
    with torch.no_grad():
        wants = [net(x) for x in inputs]
        if start == "new-gear":
            f(inputs[0])  # thread 0's gear is built; the others' are not
    _each_thread_gets_its_own(f, inputs, wants, steps=40, mode=torch.inference_mode, label=f"round {r} ")
    if opts.get("mode") is None:
        # each thread captured its own gear (summed over records: a thread that made
        # dynamo compile again has its captures in that compile's record)
        assert sum(g.captures for g in graphgear.stats().graphs) >= len(sizes), graphgear.stats().graphs


@pytest.mark.parametrize("start", ["cold", "new-gear"])
@pytest.mark.parametrize("opts", list(_COLD_MODES.values()), ids=list(_COLD_MODES))
def test_item5_threads_compiling_while_others_call_get_their_own_results(opts: dict, start: str) -> None:
    """No warm-up on one thread first: the threads' first calls compile (dynamo, gears
    built on first use, the CPU graph's native code, the frozen compile) while other
    threads call the compiled model. ``cold``: all four start at once; ``new-gear``: one
    thread replays a built gear while three others build gears of their own. Two rounds,
    each with a fresh model.

    Found by probing: a run-time compile (``make_fx`` inside a gear build or a capture)
    set FX's process-wide tracing flag, and dynamo refused the other threads' calls
    ("Detected that you are using FX to symbolically trace a dynamo-optimized
    function"), or two traces at once broke FX's patcher (2 of 3 runs; all six cases
    failed before ``_torch.dynamo.compile_session``)."""
    opts = dict(opts)
    serve = opts.pop("serve", False)
    for r in range(2):
        _threads_compiling_round(r, opts, serve, start)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_item5_threads_training_from_a_cold_start_get_their_own_gradients(mode: str) -> None:
    """Threads' first backward at once while another thread keeps calling the forward:
    AOTAutograd compiles the backward at the first backward call, outside dynamo (in
    max-autotune Inductor traces there); each thread's output and gradient (with respect
    to its own input) equals eager's."""
    torch.manual_seed(0)
    net = PadNet()
    f = torch.compile(net, backend=_ro(mode))
    inputs = [torch.randn(4, 8) + i for i in range(4)]
    wants = []
    for x in inputs:
        x = x.clone().requires_grad_()
        y = net(x)
        wants.append((y.detach(), torch.autograd.grad(y.square().sum(), x)[0]))
    f(inputs[0].clone().requires_grad_())  # the forward is compiled, the backward not yet
    errors: list[str] = []
    barrier = threading.Barrier(len(inputs))
    stop = threading.Event()

    def worker(k: int) -> None:
        try:
            barrier.wait()
            step = 0
            # thread 0: forward only, until the others (compiling the backward) are done
            while (not stop.is_set()) if k == 0 else step < 10:
                step += 1
                x = inputs[k].clone().requires_grad_()
                y = f(x)
                if not torch.allclose(y, wants[k][0], atol=1e-5, rtol=1e-4):
                    errors.append(f"thread {k} step {step}: wrong output")
                    return
                if k == 0:
                    continue
                (g,) = torch.autograd.grad(y.square().sum(), x)
                if not torch.allclose(g, wants[k][1], atol=1e-5, rtol=1e-4):
                    errors.append(f"thread {k} step {step}: wrong gradient")
                    return
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {k}: {type(e).__name__}: {e}\n{traceback.format_exc()}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join(timeout=600)
    stop.set()
    threads[0].join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert not errors, errors[:4]



def _release_from_another_thread(engine: Any) -> None:
    t = threading.Thread(target=engine.release)
    t.start()
    t.join()


@pytest.mark.parametrize("moment", ["before-replay", "during-replay", "during-replay-generated-code",
                                    "during-capture"])
def test_item2_release_from_another_thread_mid_call_keeps_results_right(
        moment: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """graphgear's part of ``reset()`` (an engine's ``release()``: its captures and its
    pool) run by another thread at three moments inside a call: the call returns the
    right values, raises nothing, and its output keeps its memory after the released
    arena is gone. Found by probing with ``graphgear.reset()`` in a loop beside a
    calling thread: outputs handed out into a pool released meanwhile lost their memory
    (values like 1e36), captures failed with IndexError.

    Interleavings are forced (the release runs, to its end, in a thread of its own at
    that moment) rather than raced. ``graphgear.reset()`` itself is not raced here: it
    calls ``torch.compiler.reset()``, which crashes the process when another thread
    runs any compiled function (torch 2.13, every backend, ``eager`` included)."""
    torch.manual_seed(0)
    if moment == "during-replay-generated-code":  # no kernel-call replay: the code runs
        monkeypatch.setattr(CPUGraph, "_build_program", lambda self, outs=None: None)
    net = PadNet().eval()
    f = torch.compile(net, backend=_ro())
    x = torch.randn(4, 8)
    with torch.inference_mode():
        want = net(x)
        f(x)  # warm-up
        if moment != "during-capture":
            f(x)  # captured
    (engine,) = [o for o in gc.get_objects()
                 if type(o) is graphgear.capture.CaptureEngine and o.record is _rec()]
    fired = []

    def once() -> None:
        if not fired:
            fired.append(True)
            _release_from_another_thread(engine)

    if moment == "before-replay":  # between the entry's lookup and its replay
        orig_inv = MemoryPool.invalidate

        def invalidate(self: MemoryPool, *a: Any, **k: Any) -> int:
            once()
            return orig_inv(self, *a, **k)

        monkeypatch.setattr(MemoryPool, "invalidate", invalidate)
    elif moment == "during-replay":  # the replay has read its kernel calls
        orig_replay = CPUGraph.replay

        def replay(self: CPUGraph) -> Any:
            assert self.program is not None, "this graph should replay as kernel calls"
            calls = self.program.calls
            fn, a, kw = calls[0]
            self.program.calls = [((lambda *x, **k: (once(), fn(*x, **k))[1]), a, kw)] + calls[1:]
            try:
                return orig_replay(self)
            finally:
                if self.program is not None:
                    self.program.calls = calls

        monkeypatch.setattr(CPUGraph, "replay", replay)
    elif moment == "during-replay-generated-code":  # the replay has read its record
        orig_replay = CPUGraph.replay

        def replay(self: CPUGraph) -> Any:
            assert self.program is None
            run = self.executor.run
            self.executor.run = lambda a: (once(), run(a))[1]
            try:
                return orig_replay(self)
            finally:
                self.executor.run = run

        monkeypatch.setattr(CPUGraph, "replay", replay)
    else:  # the capture has taken its first block, not yet noted its buffer there
        orig_block = MemoryPool.block

        def block(self: MemoryPool, *a: Any, **k: Any) -> torch.UntypedStorage:
            blk = orig_block(self, *a, **k)
            once()
            return blk

        monkeypatch.setattr(MemoryPool, "block", block)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "could not capture" either
        y = f(x)
    assert fired
    monkeypatch.undo()
    gc.collect()
    junk = _churn(y.numel() * 4)
    assert torch.allclose(y, want, atol=1e-5, rtol=1e-4), (y - want).abs().max()
    del junk
    with torch.inference_mode():  # and the engine captures again afterwards
        for _ in range(3):
            assert torch.allclose(f(x), want, atol=1e-5, rtol=1e-4)
    assert engine.entries and all(e.graph is not None for e in engine.entries.values())


class _Boom(RuntimeError):
    pass


@torch.no_grad()
def test_item7_failed_capture_mutates_inputs_exactly_once(monkeypatch: pytest.MonkeyPatch) -> None:
    real = CPUGraph.capture

    def fails_after_running(self, args):  # type: ignore[no-untyped-def]
        real(self, args)  # the graph ran (the cache was written) ...
        raise _Boom("capture failed after the run")  # ... then the capture failed

    monkeypatch.setattr(CPUGraph, "capture", fails_after_running)
    net = AddCache()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    x = torch.randn(1, 8)
    cache, ref_cache = torch.zeros(1, 8), torch.zeros(1, 8)
    with pytest.warns(UserWarning, match="could not capture"):
        out = f(x, cache)
    want = net(x, ref_cache)
    assert_close(cache, ref_cache, reduction=64)  # once, not twice
    assert_close(out, want, reduction=64)
    assert_close(f(x, cache), net(x, ref_cache), reduction=64)
    assert_close(cache, ref_cache, reduction=64)


@torch.no_grad()
def test_item7_interrupt_mid_capture_leaves_inputs_and_slots_as_they_were(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (KeyboardInterrupt) after the capture's run wrote the cache: it reaches
    the caller, the cache is as passed, the capture slot is free again (capture_limit=1
    still lets the next call capture) and the next call captures and is right."""
    real = CPUGraph.capture
    hits = []

    def interrupted(self, args):  # type: ignore[no-untyped-def]
        outs = real(self, args)
        if not hits:
            hits.append(1)
            raise KeyboardInterrupt
        return outs

    monkeypatch.setattr(CPUGraph, "capture", interrupted)
    net = AddCache()
    f = torch.compile(net, backend=_ro(warmup_iters=0, capture_limit=1))
    x = torch.randn(1, 8)
    cache, ref_cache = torch.zeros(1, 8), torch.zeros(1, 8)
    with pytest.raises(KeyboardInterrupt):
        f(x, cache)
    assert_close(cache, ref_cache, reduction=64)  # not written
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "capture_limit reached"
        out = f(x, cache)
    assert_close(out, net(x, ref_cache), reduction=64)
    assert_close(cache, ref_cache, reduction=64)
    assert _rec().captures == 1 and not _rec().fallbacks


@torch.no_grad()
def test_item7_failed_capture_with_raise_leaves_inputs_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    real = CPUGraph.capture

    def fails_after_running(self, args):  # type: ignore[no-untyped-def]
        real(self, args)
        raise _Boom("capture failed after the run")

    monkeypatch.setattr(CPUGraph, "capture", fails_after_running)
    f = torch.compile(AddCache(), backend=_ro(warmup_iters=0, fallback="raise"))
    cache = torch.zeros(1, 8)
    with pytest.raises(graphgear.CaptureError, match="inputs are unchanged"):
        f(torch.randn(1, 8), cache)
    assert bool((cache == 0).all())


class Gather(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(8, 4))

    def forward(self, idx: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        cache.add_(1.0)
        return self.table[idx] * 2


@torch.no_grad()
def test_item7_the_graphs_own_error_reaches_the_caller_once() -> None:
    net = Gather()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    cache = torch.zeros(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs uncaptured" warning: the error is the graph's
        with pytest.raises((IndexError, RuntimeError), match="index"):
            f(torch.tensor([1, 99]), cache)  # out of range
    assert bool((cache == 1).all())  # the mutation happened once, as in eager
    good = torch.tensor([1, 2])
    assert_close(f(good, cache), net(good, torch.zeros(3)), reduction=64)
    r = _rec()
    assert r.captures == 1 and r.fallbacks == []  # the next call still captures


@torch.no_grad()
def test_item9_capture_limit_holds_when_keys_round_robin() -> None:
    net = Net()
    f = torch.compile(net, backend=_ro(warmup_iters=1, capture_limit=2))
    gears = [1, 2, 3, 4, 5]
    xs = {n: torch.randn(n, 8) for n in gears}
    for x in xs.values():
        graphgear.set_dim_gears(x, {0: gears})
    with pytest.warns(UserWarning, match="capture_limit=2"):
        for _ in range(3):
            for x in xs.values():
                assert_close(f(x), net(x), reduction=64)
    assert _rec().captures == 2
    assert any(op == "capture_limit" for op, _ in _rec().fallbacks)


@torch.no_grad()
def test_item10_two_kv_caches_used_alternately_replay() -> None:
    net = CacheWriter()
    f = torch.compile(net, backend=_ro())
    caches = [torch.zeros(6, 8), torch.zeros(6, 8)]
    refs = [torch.zeros(6, 8), torch.zeros(6, 8)]
    for step in range(12):
        k = step % 2
        x, pos = torch.randn(1, 8), torch.tensor([step // 2])
        assert_close(f(x, pos, caches[k]), net(x, pos, refs[k]), reduction=64)
        assert_close(caches[k], refs[k], reduction=64)
    r = _rec()
    assert r.captures == 1 and r.replays >= 10 and r.fallbacks == []


@torch.no_grad()
def test_item11_output_fed_back_as_next_input() -> None:
    net = Net()
    f = torch.compile(net, backend=_ro(clone_input=False))
    x = ref = torch.randn(2, 8)
    for _ in range(6):
        x = f(x)
        ref = net(ref)
        assert_close(x, ref, reduction=64)
    assert _rec().captures == 1


def test_item16a_effect_tokens_in_reduce_overhead(capfd: pytest.CaptureFixture[str]) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        torch.ops.aten._print("graphgear-effect")
        return x * 2

    f = torch.compile(fn, backend=_ro())
    x = torch.randn(3)
    for _ in range(4):
        assert_close(f(x), x * 2, reduction=64)
    printed = capfd.readouterr().out.count("graphgear-effect")
    assert printed == 4  # the side effect runs on every call, captured or not


def test_item18_reset_frees_a_custom_pools_memory() -> None:
    pool = MemoryPool()
    f = torch.compile(Net(), backend=_ro(warmup_iters=0, use_custom_pool=pool))
    with torch.no_grad():
        f(torch.randn(2, 8))
        f(torch.randn(2, 8))
    assert pool.nbytes > 0
    graphgear.reset()
    assert pool.nbytes == 0 and "0 blocks" in repr(pool)


# ---- passes, gears and backend (items 6, 8, 12, 13, 14, 15) ----

MODES = ["eager", "max-autotune", "reduce-overhead"]


class _NoopOutputs(torch.nn.Module):
    """Returns ``x + 0``, ``self.w * 1`` and ``(x * 1).view(-1)``: removing the no-ops
    would hand back the input, the weight, and a view of the input."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x + 0, self.w * 1, (x * 1).view(-1), self.w.view(12) * 1


@pytest.mark.parametrize("mode", MODES)
def test_item6_noop_removal_never_aliases_outputs_to_inputs_or_weights(mode: str) -> None:
    model = _NoopOutputs()
    w_before = model.w.detach().clone()
    compiled = torch.compile(model, backend=make_backend(mode))
    x = torch.randn(4, 3)
    x_before = x.clone()
    for _ in range(3):  # reduce-overhead: warm-up, capture, replay
        with torch.no_grad():
            outs = compiled(x)
            expected = model(x)
        assert_close(outs, expected)
        for i, out in enumerate(outs):
            for what, t in (("x", x), ("w", model.w)):
                assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr(), (
                    f"{mode}: output {i} shares memory with {what}"
                )
            out.mul_(0)
        torch.testing.assert_close(model.w.detach(), w_before)
        torch.testing.assert_close(x, x_before)


def test_item6_noop_removal_keeps_distinct_outputs_and_removes_the_rest() -> None:
    from graphgear.passes.noop import RemoveNoopOps

    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = x.relu()
        return a + 0, a * 1, (x + 0).relu()  # two outputs must not become one tensor

    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(torch.randn(3))
    removed = RemoveNoopOps()(gm, [], make_config("eager"))
    gm.recompile()
    x = torch.randn(3)
    outs = gm(x)
    assert_close(outs, f(x))
    assert outs[0].untyped_storage().data_ptr() != outs[1].untyped_storage().data_ptr()
    assert removed == 2  # one of a + 0 / a * 1, and the x + 0 under relu


def _kwarg_write_graph() -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """An aten graph whose KV-cache write passes the cache as a keyword: ``self=cache``."""

    def f(cache: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor]:
        aten.index_copy_.default(cache, 0, idx, v)
        return (v * 2,)

    args = [torch.zeros(6, 3), torch.tensor([1, 4]), torch.randn(2, 3)]
    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(*args)
    (node,) = [n for n in gm.graph.nodes if n.target is aten.index_copy_.default]
    names = [a.name for a in aten.index_copy_.default._schema.arguments]
    node.kwargs = dict(zip(names, node.args))
    node.args = ()
    gm.recompile()
    return gm, args


def test_item15_mutated_placeholders_reads_keyword_arguments() -> None:
    from graphgear.inputs import mutated_placeholders

    gm, _ = _kwarg_write_graph()
    assert mutated_placeholders(gm) == [0]

    # a keyword-only mutable argument: add.out(x, y, out=dst) writes dst
    g = fx.Graph()
    x, y, dst = g.placeholder("x"), g.placeholder("y"), g.placeholder("dst")
    g.output(g.call_function(aten.add.out, (x, y), {"out": dst}))
    assert mutated_placeholders(fx.GraphModule(torch.nn.Module(), g)) == [2]


def test_item15_keyword_cache_write_reaches_the_callers_tensor() -> None:
    # reduce-overhead copies inputs it does not know to be mutated into static buffers:
    # a missed mutation would write the buffer, not the caller's cache
    gm, args = _kwarg_write_graph()
    compiled = graphgear.get_compiler(make_config("reduce-overhead"))(gm, args)
    for step in range(3):  # reduce-overhead: warm-up, capture, replay
        cache, idx, v = torch.zeros(6, 3), torch.tensor([step, 5 - step]), torch.randn(2, 3)
        expected_cache = cache.clone().index_copy_(0, idx, v)
        out = compiled(cache, idx, v)
        assert_close(out, (v * 2,))
        torch.testing.assert_close(cache, expected_cache, msg=lambda m, s=step: f"step {s}: {m}")


def test_item13_get_compiler_on_make_fx_graph_in_max_autotune() -> None:
    lin = torch.nn.Linear(8, 4)

    def f(x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.nn.functional.gelu(lin(x)),)

    x = torch.randn(3, 8)
    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(x)
    assert any(n.target is aten.t.default for n in gm.graph.nodes)  # what Inductor rejected
    compiled = graphgear.get_compiler(make_config("max-autotune"))(gm, [x])
    for _ in range(2):
        x = torch.randn(3, 8)
        with torch.no_grad():
            assert_close(compiled(x), f(x))


class _LinearRelu(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


@pytest.mark.parametrize("mode", ["eager", "max-autotune"])
def test_item14_gears_land_on_the_user_input_after_lifted_parameters(mode: str) -> None:
    # a symbolic_trace graph keeps its parameters as attributes: AOTAutograd lifts them
    # to the front of the graph's inputs, so the geared x is the last input, not input 0
    model = _LinearRelu().eval()
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(4, 16)
    graphgear.set_dim_gears(x, {0: [2, 4]})
    compiled = graphgear.get_compiler(make_config(mode))(gm, [x])
    with torch.no_grad():
        assert_close(compiled(x), model(x))
    (rec,) = [g for g in graphgear.stats().graphs if g.stage in ("forward", "inference")]
    assert rec.inputs[-1] == "x" and len(rec.inputs) == 3, rec.inputs

    # the gear is checked on x, and the error names it
    bad = torch.randn(3, 16)
    graphgear.set_dim_gears(bad, {0: [2, 4]})
    with pytest.raises(GearError, match=r"input 'x' has size 3 at dim 0.*\[2, 4\]"):
        graphgear.get_compiler(make_config(mode))(torch.fx.symbolic_trace(model), [bad])


def test_item12_rotary_op_real_and_fake_strides_agree_on_transposed_inputs() -> None:
    from graphgear.passes.ops import rotary_rotate_half

    op = torch.ops.graphgear.rotary_rotate_half.default
    # q and k as HF models pass them: proj(x).view(B, S, H, D).transpose(1, 2)
    q = torch.randn(2, 5, 4, 8, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(2, 5, 2, 8, dtype=torch.float64).transpose(1, 2)
    cos = torch.randn(2, 1, 5, 8, dtype=torch.float64)
    sin = torch.randn(2, 1, 5, 8, dtype=torch.float64)
    for x in (q, k, q[..., :4]):  # also a sliced, non-contiguous last dim
        assert not x.is_contiguous()
        c, s = cos[..., : x.shape[-1]], sin[..., : x.shape[-1]]
        torch.library.opcheck(op, (x, c, s))  # fake vs real strides, AOT dispatch
        torch.library.opcheck(op, (x.detach().requires_grad_(True), c, s))
        out = rotary_rotate_half(x, c, s)
        with torch._subclasses.FakeTensorMode() as mode:
            fake = op(mode.from_tensor(x), mode.from_tensor(c), mode.from_tensor(s))
        assert out.stride() == fake.stride() and out.is_contiguous()
        half = x.shape[-1] // 2
        ref = x * c + torch.cat((-x[..., half:], x[..., :half]), -1) * s
        torch.testing.assert_close(out, ref)
        xg, cg, sg = (t.detach().clone().requires_grad_(True) for t in (x, c, s))
        torch.autograd.gradcheck(rotary_rotate_half, (xg, cg, sg))
        # the backward of a non-contiguous x
        xt = torch.randn(2, 5, 4, 8, dtype=torch.float64, requires_grad=True)
        rotary_rotate_half(xt.transpose(1, 2), cos, sin).sum().backward()
        xr = xt.detach().clone().requires_grad_(True)
        xv = xr.transpose(1, 2)
        (xv * cos + torch.cat((-xv[..., 4:], xv[..., :4]), -1) * sin).sum().backward()
        torch.testing.assert_close(xt.grad, xr.grad)


def _qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    return Qwen2ForCausalLM(cfg)


@pytest.mark.slow
def test_item12_qwen2_training_with_fx_passes_in_reduce_overhead() -> None:
    from tests.helpers import check_against_eager

    cfg = make_config("reduce-overhead", fx_passes=True)
    fused: list[bool] = []

    def spy(gm: fx.GraphModule, example_inputs: object, config: object) -> None:
        fused.append(any(n.target is torch.ops.graphgear.rotary_rotate_half.default
                         for n in gm.graph.nodes))

    cfg.experimental_config.post_grad_custom_post_pass = spy
    model = _qwen2().train()
    check_against_eager(model, lambda: [torch.randint(0, 128, (2, 8))],
                        lambda m: torch.compile(m, backend=graphgear.get_backend(cfg)),
                        train=True, steps=3, loss_fn=lambda out: out.logits.square().mean())
    assert any(fused), "the rotary fusion did not fire: the test would not cover the op"


def _geared_rows(n: int) -> torch.Tensor:
    x = torch.randn(n, 3)
    graphgear.set_dim_gears(x, {0: [2, 4]})
    return x


@pytest.mark.parametrize("mode", MODES)
def test_item8_padding_refuses_outputs_sized_by_an_expression_of_the_gear(mode: str) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.relu(), torch.cat([x, x * 2])  # rows [x, 2x]: padding puts zeros mid-way

    def g(x: torch.Tensor) -> torch.Tensor:
        return (x + 1).reshape(-1)

    def h(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x @ w  # rows independent: dims of size s are sliced back, size 0 included
        return y, (y[:, None, :] * y[None, :, :]).sum(-1)  # (s, 3) and (s, s)

    cf = torch.compile(f, backend=make_backend(mode, gear_padding=True))
    cg = torch.compile(g, backend=make_backend(mode, gear_padding=True))
    ch = torch.compile(h, backend=make_backend(mode, gear_padding=True))
    w = torch.randn(3, 3)
    for n in (4, 3, 0, 2, 1):
        x = _geared_rows(n)
        out = ch(x, w)
        assert [tuple(t.shape) for t in out] == [(n, 3), (n, n)]
        assert_close(out, h(x, w))
        if n in (2, 4):  # gears: no padding, exact results
            assert_close(cf(x), f(x))
            assert_close(cg(x), g(x))
            continue
        with pytest.raises(GearError) as e:
            cf(x)
        msg = str(e.value)
        assert "input 'x' dim 0" in msg and f"has size {n}, padded to gear" in msg, msg
        assert re.search(r"output 1 \(\w+\) has size 2\*s\d+ at dim 0", msg), msg
        assert "gear_padding = False" in msg and "[2, 4]" in msg, msg
        with pytest.raises(GearError, match=r"output 0 \(\w+\) has size 3\*s\d+ at dim 0"):
            cg(x)


# ---- files and tolerances (items 16, 17, 19) ----

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _private_dir(path: str) -> None:
    st = os.lstat(path)
    assert stat.S_ISDIR(st.st_mode), path
    assert st.st_uid == os.getuid(), f"{path} owned by uid {st.st_uid}"
    assert stat.S_IMODE(st.st_mode) == 0o700, f"{path} mode {stat.S_IMODE(st.st_mode):o}"


def test_item16_suite_uses_a_private_per_user_inductor_cache() -> None:
    """conftest picked the cache: per-user (under the user's cache root: ``~/.cache``, or
    ``$XDG_CACHE_HOME`` where the user set one), mode 0700, not a fixed shared name under
    the temporary directory."""
    from graphgear.cache.store import default_cache_root, inductor_cache_dir

    chosen = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert chosen != os.path.join(tempfile.gettempdir(), "graphgear-inductor-cache")
    if not default_cache_root().startswith(tempfile.gettempdir() + os.sep):
        assert not chosen.startswith(tempfile.gettempdir() + os.sep), chosen
    _private_dir(chosen)
    _private_dir(os.path.dirname(chosen))

    assert chosen == inductor_cache_dir()
    assert chosen == os.path.join(default_cache_root(), "graphgear", "inductor")


def test_item16_cache_dir_respects_xdg_and_is_created_private(tmp_path, monkeypatch) -> None:
    from graphgear.cache.store import inductor_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = inductor_cache_dir()
    assert path == str(tmp_path / "xdg" / "graphgear" / "inductor")
    _private_dir(path)
    _private_dir(os.path.dirname(path))


@pytest.mark.parametrize("where", ["inductor", "graphgear"])
def test_item16_world_writable_cache_folder_is_not_used(tmp_path, monkeypatch, caplog, where) -> None:
    from graphgear.cache.store import inductor_cache_dir

    planted = tmp_path / "xdg" / "graphgear"
    (planted / "inductor").mkdir(parents=True)
    os.chmod(planted / where if where == "inductor" else planted, 0o777)
    (planted / "inductor" / "planted.py").write_text("raise SystemExit('planted')\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with caplog.at_level(logging.WARNING, logger="graphgear.cache.store"):
        path = inductor_cache_dir()
    assert not path.startswith(str(planted)), path
    assert os.listdir(path) == []  # a fresh folder, nothing planted in it
    _private_dir(path)
    assert "writable by group or others" in caplog.text and str(planted) in caplog.text


def test_item16_explicit_unsafe_cache_dir_is_replaced(tmp_path, monkeypatch, caplog) -> None:
    from graphgear.cache.store import use_private_inductor_cache

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared))
    with caplog.at_level(logging.WARNING, logger="graphgear.cache.store"):
        path = use_private_inductor_cache()
    assert path != str(shared) and os.environ["TORCHINDUCTOR_CACHE_DIR"] == path
    _private_dir(path)
    assert str(shared) in caplog.text


def test_item16_benchmarks_and_scripts_use_the_private_cache(tmp_path) -> None:
    """Each benchmark and script, loaded in a fresh process with no cache set, sets
    ``TORCHINDUCTOR_CACHE_DIR`` to the private per-user folder."""
    files = sorted(os.path.join("benchmarks", f) for f in os.listdir(os.path.join(_ROOT, "benchmarks"))
                   if f.endswith(".py"))
    files.append(os.path.join("scripts", "gpu_check.py"))
    code = (
        "import os, runpy, sys, json\n"
        "out = {}\n"
        "for f in sys.argv[1:]:\n"
        "    os.environ.pop('TORCHINDUCTOR_CACHE_DIR', None)\n"
        "    runpy.run_path(f, run_name='not_main')\n"
        "    out[f] = os.environ.get('TORCHINDUCTOR_CACHE_DIR')\n"
        "print(json.dumps(out))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(_ROOT, "src"), _ROOT, env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-c", code, *files], cwd=_ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    got = json.loads(res.stdout.strip().splitlines()[-1])
    want = str(tmp_path / "xdg" / "graphgear" / "inductor")
    assert got == {f: want for f in files}


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu())


def _dump_run(folder: str) -> torch.Tensor:
    cfg = graphgear.CompilerConfig()
    cfg.mode = "reduce-overhead"
    cfg.debug.run_eagerly = True
    cfg.debug.graph_dump.type = "txt"
    cfg.debug.graph_dump.path = folder
    cfg.debug.fx_summary.type = "csv"
    cfg.debug.fx_summary.path = folder
    torch._dynamo.reset()
    graphgear.reset()
    torch.manual_seed(0)
    model = _MLP()
    x = torch.randn(2, 8)
    with torch.no_grad():
        out = torch.compile(model, backend=graphgear.get_backend(cfg))(x)
        assert_close(out, model(x), reduction=8)
    return out


def test_item17_debug_dumps_do_not_follow_planted_symlinks(tmp_path, caplog) -> None:
    from graphgear import debug

    probe = tmp_path / "probe"
    _dump_run(str(probe))
    names = sorted(os.listdir(probe))
    assert names and any(n.endswith(".csv") for n in names) and any(n.endswith(".txt") for n in names)
    suffixes = {n.split("_", 2)[2] for n in names}  # gg_<seq>_<rest>: keep <rest>

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    nxt = debug._next_seq() + 1  # the counter is process-wide: the next run starts here
    for seq in range(nxt, nxt + 100):
        for rest in suffixes:
            os.symlink(victim, dumps / f"gg_{seq:05d}_{rest}")
    with caplog.at_level(logging.WARNING, logger="graphgear.debug"):
        _dump_run(str(dumps))  # compiles and runs correctly
    assert victim.read_text() == "precious\n"
    refused = [r.getMessage() for r in caplog.records if "symlink" in r.getMessage()]
    assert len(refused) == len(names), refused
    assert all(str(dumps) in m for m in refused)
    assert all(os.path.islink(dumps / n) for n in os.listdir(dumps))  # nothing else written


def test_item17_dumps_replace_a_link_planted_after_the_check(tmp_path, monkeypatch) -> None:
    """A symlink that appears between the check and the write is replaced, not followed;
    a regular file from an earlier run is overwritten as before."""
    from graphgear import dumpfiles

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    path = tmp_path / "gg_00001_x_final.txt"
    real_mkstemp = tempfile.mkstemp

    def racing_mkstemp(*args, **kwargs):
        os.symlink(victim, path)  # planted after the lstat check
        return real_mkstemp(*args, **kwargs)

    monkeypatch.setattr(dumpfiles.tempfile, "mkstemp", racing_mkstemp)
    assert dumpfiles.write_dump(str(path), "dump\n")
    assert victim.read_text() == "precious\n"
    assert not path.is_symlink() and path.read_text() == "dump\n"
    monkeypatch.setattr(dumpfiles.tempfile, "mkstemp", real_mkstemp)
    assert dumpfiles.write_dump(str(path), "again\n") and path.read_text() == "again\n"
    assert sorted(os.listdir(tmp_path)) == ["gg_00001_x_final.txt", "victim.txt"]


def _summed_in_another_order(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row sums of ``x`` (n, k) in float32: one pass, and in 7 chunks (another order)."""
    a = x.sum(-1)
    b = torch.stack([c.sum(-1) for c in x.split(max(k // 7, 1), dim=-1)], -1).sum(-1)
    return a, b


def test_item19_policy_accepts_a_summation_order_difference() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 1024, generator=g)
    a, b = _summed_in_another_order(x, 1024)
    assert not torch.equal(a, b)  # the order changed the float32 result
    assert_close(a, b, reduction=1024)
    # the old fixed tolerance of test_passes failed on such differences
    exact = x.double().sum(-1)
    assert_close(a.double(), exact, reduction=1024, dtype=torch.float32)


def test_item19_policy_catches_a_real_error() -> None:
    g = torch.Generator().manual_seed(0)
    expected = torch.randn(256, 64, generator=g)
    for k in (1, 64, 4096):
        wrong = expected.clone()
        i = int(expected.abs().argmax())
        wrong.view(-1)[i] *= 1 + 1e-3  # one element, 1e-3 relative
        with pytest.raises(AssertionError, match="Mismatched elements: 1 / 16384"):
            assert_close(wrong, expected, reduction=k)
        wrong = expected * (1 + 1e-3)  # every element 1e-3 relative
        with pytest.raises(AssertionError):
            assert_close(wrong, expected, reduction=k)
    with pytest.raises(AssertionError):  # a tensor that must be zero is exactly zero
        assert_close(torch.full((3,), 1e-9), torch.zeros(3), reduction=4096)
    with pytest.raises(AssertionError):  # integers compare exactly
        assert_close(torch.tensor([1, 2]), torch.tensor([1, 3]), reduction=4096)


def test_item19_tolerance_scales_with_magnitude_reduction_and_dtype() -> None:
    e = torch.tensor([0.5, -2.0, float("inf")])
    t1, t4 = tolerance(e, reduction=1), tolerance(e, reduction=4)
    assert t1["atol"] == pytest.approx(16 * torch.finfo(torch.float32).eps * 2.0)
    assert t4["atol"] == pytest.approx(2 * t1["atol"])  # sqrt(reduction)
    assert tolerance(e * 10)["atol"] == pytest.approx(10 * t1["atol"])
    assert t1["rtol"] == pytest.approx(8 * torch.finfo(torch.float32).eps)
    assert tolerance(e.half())["rtol"] > 1000 * t1["rtol"]
    assert tolerance(e, dtype=torch.bfloat16)["atol"] > t1["atol"]
    assert tolerance(torch.tensor([1, 2]), reduction=100) == {"rtol": 0.0, "atol": 0.0}


def test_item19_decoder_training_gradients_at_one_and_two_threads() -> None:
    """The training check of test_passes (fusions on, gradients vs eager) at 1 and 2
    intra-op threads: summation order differs, the policy accepts it."""
    from tests.test_passes import eager_config, run_decoder

    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            graphgear.reset()
            torch._dynamo.reset()
            graphgear.reset()
            run_decoder(eager_config(fx_passes=True), train=True)
    finally:
        torch.set_num_threads(before)
        graphgear.reset()


def test_a_process_that_exits_after_replays_prints_no_shutdown_errors() -> None:
    """Weak storage references collected at interpreter exit printed "Exception ignored
    in StorageWeakRef.__del__ ... 'NoneType' object has no attribute 'UntypedStorage'"
    (module globals already cleared) after every script that replayed a graph."""
    child = (
        "import torch, graphgear\n"
        "def fb(x):\n"
        "    y = torch.sin(x) + 1\n"
        "    torch._dynamo.graph_break()\n"
        "    return y, torch.cos(y) * 2\n"
        "k = torch.compile(fb, backend='graphgear', options={'mode': 'reduce-overhead'})\n"
        "for i in range(4):\n"
        "    y, z = k(torch.full((4,), float(i)))\n"
        "print('ok', float(z[0]))\n"
    )
    p = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]
    assert "Exception ignored" not in p.stderr, p.stderr[-3000:]


def test_the_extension_build_folder_is_private_at_every_level(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU graph's extension folder is made under the user's cache root with every
    folder it creates at mode 0700: ``mkdir(parents=True, mode=0o700)`` made the parents
    0755, and a later process then refused ``~/.cache/graphgear`` as the Inductor cache
    (it fell back to a cold temporary folder, with a warning)."""
    from graphgear.cache.store import inductor_cache_dir, make_private_dirs
    from graphgear.capture import liveness

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("GRAPHGEAR_EXTENSIONS_DIR", raising=False)
    folder = liveness.extension_dir()
    assert str(folder).startswith(str(tmp_path / "cache"))
    make_private_dirs(str(folder))
    for f in (folder, folder.parent, folder.parent.parent, tmp_path / "cache"):
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o700, f
    # the Inductor cache beside it is taken, not refused
    assert inductor_cache_dir(str(tmp_path / "cache")) == str(tmp_path / "cache" / "graphgear" / "inductor")
    make_private_dirs(str(folder))  # existing folders are fine
    src = Path(liveness.__file__).read_text()
    assert "make_private_dirs(str(folder))" in src and "mkdir(parents=True" not in src

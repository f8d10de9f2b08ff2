"""cache_compile used the way TorchAir's users write it (tests/models/cache_users.py: model
classes in their own module): each pattern, in both modes, with gears set on the first
call's tensor and the other sizes arriving one call at a time as plain tensors, is served
by a second process from the cache (every graph a hit, no dynamo trace, bit-identical
outputs); a gear first seen later is stored once and hit by a third process; what torch's
precompile cannot save runs uncached with one warning; a cache that cannot be written or
an entry that cannot be trusted never breaks the call, and a planted payload never runs."""

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
from graphgear.inference import cache_compile

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "cache_patterns_worker.py"
MODES = ["max-autotune", "reduce-overhead"]


def _run(folder: Path, pattern: str, mode: str, sizes: str, gears: str = "2,4,8",
         extra: tuple[str, ...] = ()) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    p = subprocess.run([sys.executable, str(WORKER), pattern, "--mode", mode, "--dir", str(folder),
                        "--sizes", sizes, "--gears", gears, *extra],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
    out["log"] = p.stderr
    return out


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    return folder


def _assert_served_from_cache(first: dict[str, Any], second: dict[str, Any]) -> None:
    assert [r["cache"] for r in first["records"]] == ["stored"], first["log"][-3000:]
    assert [r["cache"] for r in second["records"]] == ["hit"], second["log"][-3000:]
    assert second["unique_graphs"] == 0 and second["frames_ok"] == 0  # no dynamo trace at all
    assert [c["sha"] for c in second["calls"]] == [c["sha"] for c in first["calls"]]  # bit-identical
    assert all(c["err"] < 1e-4 for c in first["calls"] + second["calls"])  # close to eager
    assert "graphgear cache: refusing" not in second["log"]


@pytest.mark.inductor
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pattern, sizes", [("method", "4,2,8"), ("function", "8,2,4,8"), ("module", "4,2,8")])
def test_second_process_serves_every_gear(tmp_path: Path, pattern: str, sizes: str, mode: str) -> None:
    folder = _folder(tmp_path)
    first = _run(folder, pattern, mode, sizes)
    _assert_served_from_cache(first, _run(folder, pattern, mode, sizes))


@pytest.mark.inductor
@pytest.mark.parametrize("mode", MODES)
def test_second_process_serves_a_graph_with_a_host_read(tmp_path: Path, mode: str) -> None:
    """``.item()`` in the middle of the step. The entry held the shape env's record of
    where the unbacked size was made (a ``CapturedTraceback``), which the allow-list
    refused: every later process compiled again. In reduce-overhead the graph is captured
    in two pieces per key, and their code is stored and loaded too (it compiled again)."""
    folder = _folder(tmp_path)
    first = _run(folder, "host-read", mode, "4,2,8,4,2,8,4")
    second = _run(folder, "host-read", mode, "4,2,8,4,2,8,4")
    _assert_served_from_cache(first, second)
    (rec,) = second["records"]
    assert rec["compiles"] == 0 and rec["loaded_keys"] == 3, second["log"][-3000:]
    if mode == "reduce-overhead":
        assert first["records"][0]["pieces"] == rec["pieces"] == 2
        assert rec["replays"] > 0  # the loaded pieces were captured and replayed


def _assert_every_entry_hit(first: dict[str, Any], second: dict[str, Any], entries: int) -> None:
    assert [r["cache"] for r in first["records"]] == ["stored"] * entries, first["log"][-3000:]
    assert [r["cache"] for r in second["records"]] == ["hit"] * entries, second["log"][-3000:]
    assert second["unique_graphs"] == 0 and second["frames_ok"] == 0
    assert [c["sha"] for c in second["calls"]] == [c["sha"] for c in first["calls"]]
    assert all(c["err"] < 1e-4 for c in first["calls"] + second["calls"])
    for log_text in (first["log"], second["log"]):
        assert "reject this call" not in log_text and "graphgear cache: refusing" not in log_text


@pytest.mark.inductor
@pytest.mark.parametrize("mode", MODES)
def test_module_state_changed_between_calls_is_an_entry_of_its_own(tmp_path: Path, mode: str) -> None:
    """An attribute the forward reads, set by the caller between calls: the first
    entry's guards reject the other state, which ran uncached in every process. Each
    state is now an entry of its own (a variant of the same input spec), stored, and both
    are hit by a second process."""
    folder = _folder(tmp_path)
    first = _run(folder, "two-states", mode, "4,4,2,2,8,8")
    second = _run(folder, "two-states", mode, "4,4,2,2,8,8")
    _assert_every_entry_hit(first, second, entries=2)
    assert sorted(p.name.endswith("-v1.ggc") for p in folder.glob("*.ggc")) == [False, True]


@pytest.mark.slow
@pytest.mark.parametrize("mode, pieces", [("max-autotune", False), ("reduce-overhead", False),
                                          ("reduce-overhead", True)])
def test_second_process_serves_transformers_decode_steps_with_a_static_cache(
        tmp_path: Path, mode: str, pieces: bool) -> None:
    """A Llama's bound ``forward`` with a ``StaticCache``, as servers call it. No Llama
    could be stored (the ``kernels`` package's local ``Func`` class in the guards), and
    the first step's entry (the cache not yet made) rejected every later step. Both
    states are stored; a second process hits both, logits and KV cache equal eager.
    ``pieces``: captured in pieces around attention (``split_ops``), whose code is stored
    and loaded too."""
    folder = _folder(tmp_path)
    extra = ("--split-sdpa",) if pieces else ()
    first = _run(folder, "hf-static-cache", mode, "1,1,1,1,1", extra=extra)
    second = _run(folder, "hf-static-cache", mode, "1,1,1,1,1", extra=extra)
    _assert_every_entry_hit(first, second, entries=2)
    if pieces:
        assert [r["pieces"] for r in second["records"]] == [3, 3]  # 2 layers: 2 splits, 3 pieces
        assert [r["compiles"] for r in second["records"]] == [0, 0]
        assert [r["loaded_keys"] for r in second["records"]] == [1, 1]
        assert second["records"][1]["replays"] > 0


@pytest.mark.inductor
def test_a_dim_marked_dynamic_without_gears_is_served_from_the_entry(tmp_path: Path) -> None:
    """``torch._dynamo.mark_dynamic`` instead of gears, max-autotune: the graph is dynamic
    without gears and compiles again on a hit. That compile ran inside torch's load, whose
    tracing context has another fake mode: where Inductor's FX graph cache did not have the
    graph (off here; a cold cache), it failed ("Mixing fake modes"), so every later process
    refused the entry and traced and compiled from scratch."""
    from tests.models.cache_users import MLP

    folder = _folder(tmp_path)
    cfg = graphgear.CompilerConfig()
    cfg.mode = "max-autotune"
    model = MLP().eval()
    # torch's own config patch: a monkeypatch of the config module deletes the option on undo
    with torch._inductor.config.patch(fx_graph_cache=False):
        for want in ("stored", "hit"):
            torch.compiler.reset()
            graphgear.reset()
            served = cache_compile(model, config=cfg, cache_dir=str(folder))
            x = torch.randn(6, 16)
            torch._dynamo.mark_dynamic(x, 0)
            with torch.no_grad():
                torch.testing.assert_close(served(x), model(x))
            assert [r.cache for r in graphgear.stats().graphs] == [want]
    assert torch._inductor.config.fx_graph_cache is not False


@pytest.mark.inductor
def test_a_state_past_the_variants_runs_uncached_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from graphgear.cache import function
    from tests.models.cache_users import TwoStateMLP

    monkeypatch.setattr(function, "MAX_VARIANTS", 1)
    model = TwoStateMLP().eval()
    cfg = graphgear.CompilerConfig()
    cfg.mode = "max-autotune"
    served = cache_compile(model, config=cfg, cache_dir=str(_folder(tmp_path)))
    x = torch.randn(4, 16)
    with caplog.at_level(logging.WARNING, logger="graphgear"):
        for state in (False, True, False, True):
            model.residual = state
            with torch.no_grad():
                torch.testing.assert_close(served(x), model(x))
    assert caplog.text.count("reject this call") == 1 and "at most 1 entries" in caplog.text
    assert served.stores == 1


@pytest.mark.inductor
def test_stored_pieces_cut_otherwise_compile_again_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Stored pieces are used only where the graph is cut into the same pieces (ops and
    inputs per piece); otherwise they compile, with a warning, and the outputs are right."""
    from graphgear.compilers import reduce_overhead
    from tests.models.cache_users import HostReadMLP

    folder = _folder(tmp_path)
    cfg = graphgear.CompilerConfig()
    cfg.mode = "reduce-overhead"
    model = HostReadMLP().eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        want = model(x)
    first = cache_compile(model, config=cfg, cache_dir=str(folder))
    for _ in range(3):
        torch.testing.assert_close(first(x), want)
    assert graphgear.stats().graphs[-1].cache == "stored"
    torch.compiler.reset()
    graphgear.reset()
    # the same cut: a hit, the pieces' code loaded (the graph has no gears: a static key,
    # cut again from the graph rebuilt from the entry)
    again = cache_compile(model, config=cfg, cache_dir=str(folder))
    with caplog.at_level(logging.INFO, logger="graphgear.compilers.reduce_overhead"):
        for _ in range(3):
            torch.testing.assert_close(again(x), want)
    assert "captured in 2 pieces" in caplog.text and "their code loaded from the compile cache" in caplog.text
    caplog.clear()
    rec = graphgear.stats().graphs[-1]
    assert (rec.cache, rec.compiles, len(rec.pieces)) == ("hit", 0, 2) and rec.replays > 0, graphgear.stats()
    torch.compiler.reset()
    graphgear.reset()
    real = reduce_overhead.pieces_signature
    monkeypatch.setattr(reduce_overhead, "pieces_signature", lambda pieces: real(pieces) + " (another cut)")
    second = cache_compile(model, config=cfg, cache_dir=str(folder))
    with caplog.at_level(logging.WARNING, logger="graphgear"):
        for _ in range(3):
            torch.testing.assert_close(second(x), want)
    rec = graphgear.stats().graphs[-1]
    assert rec.cache == "hit" and len(rec.pieces) == 2 and rec.replays > 0
    assert "was stored cut into other pieces" in caplog.text and "compiling its pieces instead" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pattern", ["hf-closure", "hf-forward"])
def test_second_process_serves_a_transformers_model(tmp_path: Path, pattern: str, mode: str) -> None:
    """GPT-NeoX (a family the other cache tests do not use): a closure returning
    ``.logits`` and the bound ``forward`` called with keywords (a ModelOutput back)."""
    folder = _folder(tmp_path)
    first = _run(folder, pattern, mode, "4,2,4,2", gears="2,4")
    _assert_served_from_cache(first, _run(folder, pattern, mode, "4,2,4,2", gears="2,4"))


@pytest.mark.inductor
def test_gear_first_seen_later_is_stored_once_and_hit_by_a_third_process(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    first = _run(folder, "method", "max-autotune", "4,2")
    second = _run(folder, "method", "max-autotune", "4,8")  # 8: not in the entry yet
    assert [r["cache"] for r in second["records"]] == ["hit"] and second["unique_graphs"] == 0
    assert second["stores"] == 1  # stored again once, for the new gear
    third = _run(folder, "method", "max-autotune", "4,2,8")
    assert [r["cache"] for r in third["records"]] == ["hit"] and third["unique_graphs"] == 0
    assert third["records"][0]["loaded_keys"] == 3 and third["stores"] == 0
    assert third["calls"][0]["sha"] == first["calls"][0]["sha"] == second["calls"][0]["sha"]
    assert third["calls"][2]["sha"] == second["calls"][1]["sha"]


@pytest.mark.inductor
def test_a_local_class_runs_uncached_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Local(torch.nn.Module):  # defined in local scope: torch's precompile cannot save it
        def __init__(self) -> None:
            super().__init__()
            self.l = torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.l(x))

    model = Local().eval()
    served = cache_compile(model, cache_dir=str(_folder(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="graphgear.cache"):
        for i, b in enumerate([4, 2, 4]):
            x = torch.randn(b, 8)
            if i == 0:
                graphgear.set_dim_gears(x, {0: [2, 4]})
            with torch.no_grad():
                torch.testing.assert_close(served(x), model(x))
    warnings = [r.getMessage() for r in caplog.records if "cannot be stored" in r.getMessage()]
    assert len(warnings) == 1 and "local" in warnings[0] and "module level" in warnings[0], warnings
    records = graphgear.stats().graphs
    assert records and all(r.cache == "unsupported" and "local" in r.cache_reason for r in records)
    assert not list((tmp_path / "cache").glob("*.ggc"))


def test_the_wrapper_pickles_as_a_placeholder_and_deepcopies_whole(tmp_path: Path) -> None:
    import copy
    import pickle

    from tests.models.cache_users import SelfCachedMLP

    model = SelfCachedMLP(graphgear.CompilerConfig(), str(_folder(tmp_path)))
    loaded = pickle.loads(pickle.dumps(model))
    with pytest.raises(RuntimeError, match="was unpickled.*cache_compile"):
        loaded(torch.randn(2, 16))
    clone = copy.deepcopy(model)
    assert clone.cached_forward is not model.cached_forward
    assert clone.cached_forward.fn.__self__ is clone  # the copy serves the copy's weights


@pytest.mark.inductor
def test_a_cache_that_cannot_be_written_still_returns_outputs(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from graphgear.cache import function as gcache
    from tests.models.cache_users import SelfCachedMLP

    def disk_full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gcache, "_write_entry", disk_full)
    model = SelfCachedMLP(graphgear.CompilerConfig(), str(_folder(tmp_path))).eval()
    with caplog.at_level(logging.WARNING, logger="graphgear.cache"):
        for b in (4, 2):
            x = torch.randn(b, 16)
            if b == 4:
                graphgear.set_dim_gears(x, {0: [2, 4]})
            with torch.no_grad():
                torch.testing.assert_close(model(x), model._forward(x))
    stores = [r.getMessage() for r in caplog.records if "could not store" in r.getMessage()]
    assert stores and "No space left" in stores[0], [r.getMessage() for r in caplog.records]
    assert [r.cache for r in graphgear.stats().graphs] == ["miss"]


def _plant(entry: Path, marker: Path) -> None:
    """Replace the payload with a pickle that would create ``marker`` if it ever ran."""
    import pickle

    class Boom:
        def __reduce__(self) -> Any:
            return (open, (str(marker), "w"))

    magic, header, _ = entry.read_bytes().split(b"\n", 2)  # header kept: only the checksum can tell
    entry.write_bytes(magic + b"\n" + header + b"\n" + pickle.dumps(Boom()))


@pytest.mark.inductor
@pytest.mark.parametrize("spoil", ["planted", "mode0644", "symlink", "folder0777"])
def test_method_pattern_refuses_untrusted_entries_before_unpickling(tmp_path: Path, spoil: str) -> None:
    folder = _folder(tmp_path)
    first = _run(folder, "method", "max-autotune", "4,2")
    (entry,) = folder.glob("*.ggc")
    marker = tmp_path / "ran"
    if spoil == "planted":
        _plant(entry, marker)
        os.chmod(entry, 0o600)
        reason = "checksum does not match"
    elif spoil == "mode0644":
        os.chmod(entry, 0o644)
        reason = "not 0600"
    elif spoil == "symlink":
        real = tmp_path / "elsewhere.ggc"
        os.replace(entry, real)
        entry.symlink_to(real)
        reason = "symlink"
    else:
        os.chmod(folder, 0o777)
        reason = "writable by"
    second = _run(folder, "method", "max-autotune", "4,2")
    if spoil == "folder0777":
        os.chmod(folder, 0o700)
    assert reason in second["log"], second["log"][-3000:]
    assert not marker.exists()  # the planted payload never ran
    assert "hit" not in [r["cache"] for r in second["records"]]
    assert [c["sha"] for c in second["calls"]] == [c["sha"] for c in first["calls"]]  # recompiled, same


@pytest.mark.inductor
def test_two_threads_serve_the_module_method_pattern(tmp_path: Path) -> None:
    """Two threads call TorchAir's pattern at once from the first call on, each at its own
    gear: each gets its own correct result, one entry file holds both gears."""
    from tests.helpers import run_threads
    from tests.models.cache_users import SelfCachedMLP

    model = SelfCachedMLP(graphgear.CompilerConfig(), str(_folder(tmp_path))).eval()
    inputs = [torch.randn(4, 16), torch.randn(2, 16)]
    for x in inputs:  # both marked: which thread calls first is up to the scheduler
        graphgear.set_dim_gears(x, {0: [2, 4, 8]})

    def worker(i: int) -> None:
        for _ in range(3):
            out = model(inputs[i])
            with torch.no_grad():
                torch.testing.assert_close(out, model._forward(inputs[i]))

    run_threads(worker, 2)
    assert len(list((tmp_path / "cache").glob("*.ggc"))) == 1


def test_every_fx_trace_of_the_pattern_holds_dynamos_compile_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's precompile (``aot_compile``) does not take dynamo's compile lock, and an FX
    trace patches ``nn.Module.__call__`` process-wide: two traces at once in two threads
    restore each other's patch, and every compiled call after that, in any test, fails
    with dynamo's "symbolically trace" error (the CI run that found it: 339 failures).
    Deterministic where the race is not: each trace of a store and of a run-time gear
    must hold the lock."""
    import torch.fx._symbolic_trace as fx_trace
    from torch._dynamo.convert_frame import compile_lock

    from tests.models.cache_users import SelfCachedMLP

    unlocked: list[str] = []
    original = fx_trace.Tracer.trace

    def trace(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not compile_lock._is_owned():
            unlocked.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(fx_trace.Tracer, "trace", trace)
    model = SelfCachedMLP(graphgear.CompilerConfig(), str(_folder(tmp_path))).eval()
    for n in (4, 2):  # the second gear compiles at run time, into the stored entry
        x = torch.randn(n, 16)
        graphgear.set_dim_gears(x, {0: [2, 4, 8]})
        out = model(x)
        with torch.no_grad():
            torch.testing.assert_close(out, model._forward(x))
    assert not unlocked, f"FX traces outside dynamo's compile lock: {unlocked}"

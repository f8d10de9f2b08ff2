"""graphgear.inference.cache_compile: two fresh processes hit and miss by key parts; the
loader refuses untrusted entries (mode, owner, symlink, checksum, version) and
recompiles; racing writers; rank sub-folders; the CLI's ls/clear."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import graphgear
from graphgear.cache import entry as gcache
from graphgear.cache.store import unsafe_reason
from graphgear.cli import main as cli_main
from tests.helpers import run_threads

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "cache_worker.py"


def _worker(cache_dir: Path, *extra: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    p = subprocess.run([sys.executable, str(WORKER), "--cache-dir", str(cache_dir), *extra],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    out["log"] = p.stdout + p.stderr
    return out


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.ggc"))


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("ggcache")
    os.chmod(folder, 0o700)
    first = _worker(folder)
    assert first["cache"] == ["stored"]
    return folder, first


@pytest.mark.slow
def test_second_process_hits_bit_for_bit(stored: tuple[Path, dict[str, Any]]) -> None:
    folder, first = stored
    second = _worker(folder)
    assert second["cache"] == ["hit"] and second["load_s"][0] > 0, second["log"][-4000:]
    assert second["sha"] == first["sha"]
    assert "graphgear cache: stored" not in second["log"] and len(_entries(folder)) == 1  # nothing written on a hit


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_hit_compiles_nothing_and_is_bit_equal(tmp_path: Path, mode: str) -> None:
    """A hit rebuilds every gear from the entry: no AOTAutograd trace, no graphgear
    compile (passes, specialisation), no Inductor compile (counted by dynamo's and
    Inductor's own counters), and the outputs equal the storing process's bit for bit."""
    folder = tmp_path / "m"
    folder.mkdir(mode=0o700)
    run = ("--mode", mode, "--layers", "1", "--gears", "1,2,4", "--precompile", "--steps", "2")
    first = _worker(folder, *run)
    assert first["cache"] == ["stored"] and first["compiles"] == 3 and first["aot_compiles"] == 1
    assert first["inductor_compiles"] == 3
    second = _worker(folder, *run)
    assert second["cache"] == ["hit"] and second["loaded_keys"] == 3, second
    assert (second["compiles"], second["aot_compiles"], second["inductor_compiles"]) == (0, 0, 0)
    assert second["sha"] == first["sha"] and second["steady"]
    assert second["stores"] == 0 and "graphgear cache: stored" not in second["log"]
    if first["isa_probes"]:  # x86: the entry's recorded vector ISA spares the hit Inductor's base probes
        assert second["isa_probes"] == 0, second
    if mode == "reduce-overhead":
        assert second["captures"] == 3  # device graphs are captured per process


@pytest.mark.slow
def test_hit_runs_graphgears_kernels_in_a_fresh_process(tmp_path: Path) -> None:
    """Code that calls graphgear's own kernels (the decode attention, an extern kernel
    of Inductor's generated code) loaded from the cache in a fresh process, which runs
    no pass: the kernels' lowerings and ``extern_kernels`` entries are registered before
    it runs, the CPU graph replays it as kernel calls, and the outputs equal the storing
    process's bit for bit."""
    folder = tmp_path / "k"
    folder.mkdir(mode=0o700)
    run = ("--model", "attention", "--batch", "3", "--steps", "2")
    first = _worker(folder, *run)
    assert first["cache"] == ["stored"] and first["kernel_calls"] == 1, first
    second = _worker(folder, *run)
    assert second["cache"] == ["hit"] and second["compiles"] == 0 and second["inductor_compiles"] == 0, second
    assert second["kernel_calls"] == 1 and second["sha"] == first["sha"] and second["steady"], second


@pytest.mark.slow
def test_runtime_recompile_stores_once_per_new_key_not_per_step(tmp_path: Path) -> None:
    """Steps on a compiled key write nothing; a key compiled at run time (a new batch
    size inside the gears) updates the entry once, and a third process loads it too."""
    folder = tmp_path / "r"
    folder.mkdir(mode=0o700)
    base = ("--layers", "1", "--gears", "1,2,4", "--steps", "5")
    first = _worker(folder, *base)  # batch 4 only: warm-up, capture (one store), replays
    assert first["cache"] == ["stored"] and first["stores"] == 2  # the entry, then key (4,)
    second = _worker(folder, *base, "--batch", "2")  # the same entry; key (2,) is new
    assert second["cache"] == ["hit"] and second["compiles"] == 1 and second["stores"] == 1
    third = _worker(folder, *base, "--batch", "2")
    assert third["cache"] == ["hit"] and third["compiles"] == 0 and third["stores"] == 0
    assert third["loaded_keys"] == 1 and third["sha"] == second["sha"]


def test_recorded_vector_isa_is_adopted_only_when_this_cpu_leads_to_it() -> None:
    """adopt_vec_isa: a fresh process told the ISA Inductor picks here skips the base
    probes and picks the same; told another ISA it changes nothing (Inductor probes as
    usual when it first needs to)."""
    from torch._inductor import cpu_vec_isa

    from graphgear._torch.isa import inductor_vec_isa_if_known

    cpu_vec_isa.pick_vec_isa()
    here = inductor_vec_isa_if_known()
    if here is None:
        pytest.skip("not an x86 CPU: Inductor runs no build probes to skip")
    child = (
        "import sys, json\n"
        "from torch._inductor import cpu_vec_isa as c\n"
        "from graphgear._torch.isa import adopt_vec_isa\n"
        "n = [0]; cb = c.VecISA.check_build\n"
        "def counted(self, code):\n"
        "    n[0] += code == c.VecISA._avx_code\n"
        "    return cb(self, code)\n"
        "c.VecISA.check_build = counted\n"
        "ok = adopt_vec_isa(sys.argv[1])\n"
        "cached = c.valid_vec_isa_list.cache_info().currsize\n"
        "print(json.dumps([ok, cached, str(c.pick_vec_isa()), n[0]]))\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}")

    def run(recorded: str) -> list[Any]:
        p = subprocess.run([sys.executable, "-c", child, recorded], capture_output=True, text=True, env=env,
                           timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    assert run(here) == [True, 1, here, 0]
    ok, cached, picked, probes = run("not-an-isa")
    assert (ok, cached, picked) == (False, 0, here) and probes > 0


def test_entry_unpickler_allows_only_listed_globals() -> None:
    import io
    import pickle

    for evil in (os.system, eval, getattr, __import__("subprocess").Popen):
        with pytest.raises(pickle.UnpicklingError, match="is not allowed here"):
            gcache._RestrictedUnpickler(io.BytesIO(pickle.dumps(evil))).load()
    assert not gcache.allowed_global("builtins", "eval")
    assert not gcache.allowed_global("sympy.core.sympify", "sympify")
    assert gcache.allowed_global("torch", "float16") and gcache.allowed_global("torch", "Size")
    ok = {"a": [1, 2.0, (3,)], "b": torch.Size([2, 3])}
    assert gcache._RestrictedUnpickler(io.BytesIO(pickle.dumps(ok))).load() == ok


def test_graph_unpickler_refuses_unlisted_globals() -> None:
    """The graph inside an entry goes through GraphPickler's unpickler with the same list."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphgear._torch.serialize import graph_pickle_loads
    from graphgear.cache.artifacts import ArtifactStore

    x = torch.randn(3)
    gm = make_fx(lambda x: torch.relu(x) + 1, tracing_mode="fake")(x)  # an aten graph, as AOTAutograd's
    store = ArtifactStore()
    store.keep_graph(gm, [x], {"stage": "inference"})
    assert store.graph is not None
    with pytest.raises(Exception, match="is not allowed here"):
        graph_pickle_loads(store.graph, lambda m, n: False)
    loaded, inputs = store.load_graph()  # allowed_global
    assert torch.equal(loaded(x), torch.relu(x) + 1) and tuple(inputs[0].shape) == (3,)


@pytest.mark.slow
def test_geared_entry_hits_in_a_second_process(tmp_path: Path) -> None:
    """torch 2.13's serialised guards reject tensors marked by set_dim_gears; the cache
    passes them unmarked, so a geared entry loads, passes its guards and runs."""
    folder = tmp_path / "g"
    folder.mkdir(mode=0o700)
    first = _worker(folder, "--gears", "1,2,4")
    assert first["cache"] == ["stored"]
    second = _worker(folder, "--gears", "1,2,4")
    assert second["cache"] == ["hit"] and "reject this call" not in second["log"]
    assert second["sha"] == first["sha"]


@pytest.mark.slow
@pytest.mark.parametrize("extra, part", [(("--mode", "max-autotune"), "config"),
                                         (("--gears", "1,2,4"), "gears"),
                                         (("--layers", "1"), "module"),
                                         (("--batch", "3", "--gears", "3,5"), "gears, inputs")])
def test_key_part_change_is_a_miss_naming_the_part(stored: tuple[Path, dict[str, Any]], tmp_path: Path,
                                                   extra: tuple[str, ...], part: str) -> None:
    folder, _ = stored
    copy = tmp_path / "c"
    copy.mkdir(mode=0o700)
    for e in _entries(folder):
        (copy / e.name).write_bytes(e.read_bytes())
        os.chmod(copy / e.name, 0o600)
    out = _worker(copy, *extra)
    assert out["cache"] == ["stored"]
    assert f"differ from the nearest entry: {part}" in out["log"], out["log"][-2000:]


def _refusal(stored: tuple[Path, dict[str, Any]], tmp_path: Path, spoil: Any, reason: str) -> None:
    folder, first = stored
    copy = tmp_path / "c"
    copy.mkdir(mode=0o700)
    (entry,) = _entries(folder)
    target = copy / entry.name
    target.write_bytes(entry.read_bytes())
    os.chmod(target, 0o600)
    spoil(target)
    out = _worker(copy)
    assert f"refusing {target}: " in out["log"] and reason in out["log"], out["log"][-2000:]
    assert out["cache"] == ["stored"] and out["sha"] == first["sha"]  # recompiled, same output


def _corrupt(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[-100] ^= 0xFF
    p.write_bytes(bytes(data))


def _other_version(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data.replace(b'"torch": "' + torch.__version__.encode(), b'"torch": "0.0.1', 1))


def _symlink(p: Path) -> None:
    real = p.parent.parent / "elsewhere.ggc"
    os.replace(p, real)
    p.symlink_to(real)


@pytest.mark.slow
@pytest.mark.parametrize("spoil, reason", [
    (lambda p: os.chmod(p, 0o644), "its mode is 0644, not 0600"),
    (lambda p: os.chown(p, 12345, 12345), "owned by uid 12345"),
    (_symlink, "symlink inside the cache folder"),
    (_corrupt, "checksum does not match"),
    (_other_version, "key parts differ (torch)"),
], ids=["mode0644", "chown", "symlink", "checksum", "version"])
def test_loader_refuses_and_recompiles(stored: tuple[Path, dict[str, Any]], tmp_path: Path, spoil: Any,
                                       reason: str) -> None:
    if "uid" in reason and os.getuid() != 0:
        pytest.skip("chown to another user needs root")
    _refusal(stored, tmp_path, spoil, reason)


def test_unsafe_folder_is_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "open"
    folder.mkdir()
    os.chmod(folder, 0o777)
    link = tmp_path / "link"
    link.symlink_to(folder)  # judged by what it resolves to
    fn = graphgear.inference.cache_compile(lambda x: x * 2 + 1, cache_dir=str(link))
    with caplog.at_level(logging.WARNING, logger="graphgear.cache"):
        out = fn(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 3.0))
    assert "writable by group or others" in caplog.text and str(link) in caplog.text
    assert not list(folder.iterdir())
    os.chmod(folder, 0o700)
    assert unsafe_reason(str(link), follow_symlinks=True) is None


def test_racing_writers_both_succeed_and_entry_is_whole(tmp_path: Path) -> None:
    folder = tmp_path / "race"
    folder.mkdir(mode=0o700)
    path = str(folder / "f-x.ggc")
    payloads = [bytes([i]) * 200_000 for i in range(2)]

    def write(i: int) -> None:
        for _ in range(20):
            gcache._write_entry(path, "f", "k", {"a": "b"}, payloads[i])

    run_threads(write, 2)
    header, payload = gcache._read_trusted(path)
    assert payload in payloads and header["key"] == "k"
    assert [p.name for p in folder.iterdir() if p.name.startswith(".tmp-")] == []


@pytest.mark.slow
def test_two_processes_race_both_succeed(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    folder.mkdir(mode=0o700)
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--cache-dir", str(folder), "--layers", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][1][-2000:]
    shas = {json.loads(o.splitlines()[-1][len("RESULT "):])["sha"] for o, _ in outs}
    assert len(shas) == 1 and len(_entries(folder)) == 1
    assert _worker(folder, "--layers", "1")["cache"] == ["hit"]


@pytest.mark.slow
def test_rank_gets_its_own_subfolder(tmp_path: Path) -> None:
    folder = tmp_path / "ranks"
    folder.mkdir(mode=0o700)
    out = _worker(folder, "--layers", "1", "--rank", "1")
    assert out["cache"] == ["stored"]
    assert [e.parent.name for e in _entries(folder)] == ["rank1"]
    assert _worker(folder, "--layers", "1", "--rank", "0")["cache"] == ["stored"]
    assert _worker(folder, "--layers", "1", "--rank", "1")["cache"] == ["hit"]


def test_plain_function_in_process_hit_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "fn"

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) * 3

    x = torch.randn(4, 4)
    a = graphgear.inference.cache_compile(f, cache_dir=str(folder))
    with torch.no_grad():  # entries are inference graphs (a grad-mode call falls back)
        assert torch.equal(a(x), f(x))
        assert graphgear.stats().graphs[-1].cache == "stored"
        assert oct(os.stat(folder).st_mode & 0o777) == "0o700"
        (entry,) = _entries(folder)
        assert oct(os.stat(entry).st_mode & 0o777) == "0o600"
        a(x)  # a second call writes nothing
        assert entry.stat().st_mtime_ns == _entries(folder)[0].stat().st_mtime_ns
        b = graphgear.inference.cache_compile(f, cache_dir=str(folder))  # as a new process would
        assert torch.equal(b(x), f(x)) and graphgear.stats().graphs[-1].cache == "hit"
    y = x.clone().requires_grad_()  # guards hold: grad mode on does not run the no-grad entry
    b(y).sum().backward()
    assert torch.equal(y.grad, 3 * (x > 0).float())
    assert cli_main(["cache", "ls", str(folder)]) == 0
    assert "2 entries" in capsys.readouterr().out  # one more for the requires_grad input spec
    assert cli_main(["cache", "clear", str(folder)]) == 0
    assert _entries(folder) == []


@pytest.mark.slow
def test_an_edited_generated_module_is_replaced_by_the_verified_source(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry's generated module edited on disk in Inductor's code cache was refused,
    and the key compiled again: Inductor's compile gave the same path and imported the
    edited file, so the edited code ran (a probe's edit of a constant: outputs 0.64 off,
    stats said "hit"). Now the verified source is written over it and loaded."""
    inductor = tmp_path / "inductor"
    inductor.mkdir(mode=0o700)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    folder = tmp_path / "gg"
    folder.mkdir(mode=0o700)
    first = _worker(folder)
    edited = 0
    for f in inductor.rglob("*.py"):
        text = f.read_text()
        if "def call(" in text:
            f.write_text(text + "\nraise RuntimeError('edited module imported')\n")
            edited += 1
    assert edited
    second = _worker(folder)
    assert second["cache"] == ["hit"] and second["sha"] == first["sha"], second["log"][-4000:]
    assert "writing the verified source over it" in second["log"]


def test_a_store_removes_temp_files_killed_writers_left(tmp_path: Path) -> None:
    """Was: a store killed with SIGKILL or SIGTERM left its ``.tmp-*`` file (up to 130 KB)
    in the cache folder for good; only ``graphgear cache clear`` removed it. Now a later
    store removes temporary files older than a few minutes whose writer is not alive, and
    keeps a live writer's and a young one."""
    folder = tmp_path / "tmpfiles"
    folder.mkdir(mode=0o700)
    code = ("import os, signal, sys\n"
            "from graphgear.cache import entry\n"
            "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # killed before the rename\n"
            "entry._write_entry(os.path.join(sys.argv[1], 'f-k.ggc'), 'f', 'k', {}, b'x' * 130000)\n")
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    writer = subprocess.Popen([sys.executable, "-c", code, str(folder)], env=env)
    assert writer.wait(timeout=120) == -signal.SIGKILL
    (killed,) = folder.glob(".tmp-*")
    assert killed.name.startswith(f".tmp-{writer.pid}-") and killed.stat().st_size > 130000
    old = time.time() - 2 * gcache.STALE_TMP_SECONDS
    legacy = folder / ".tmp-k2x9q1"  # an older graphgear's name, without a pid
    live = folder / f".tmp-{os.getpid()}-live"  # this process is alive: a writer's file
    young = folder / f".tmp-{writer.pid}-young"  # dead writer, but not yet a few minutes old
    for f in (legacy, live, young):
        f.write_bytes(b"x")
    for f in (killed, legacy, live):
        os.utime(f, (old, old))
    gcache._write_entry(str(folder / "g-k.ggc"), "g", "k", {}, b"payload")
    assert sorted(f.name for f in folder.glob(".tmp-*")) == sorted([live.name, young.name])
    assert [f.name for f in _entries(folder)] == ["g-k.ggc"]


def _generated_steps(x: torch.Tensor) -> Any:
    yield x * 2


@pytest.mark.parametrize(("fn", "kwargs", "error", "words"), [
    (3, {}, TypeError, ["fn must be a function", "got int (3)", "pass the function itself"]),
    (_generated_steps, {}, TypeError, ["fn _generated_steps is a generator function",
                                       "cache the function the generator calls"]),
    (torch.relu, {"config": {"mode": "reduce-overhead"}}, TypeError,
     ["config must be a graphgear.CompilerConfig, got dict", "CompilerConfig.from_dict(d)"]),
    (torch.relu, {"dynamic": "yes"}, TypeError, ["dynamic must be True or False, got 'yes' (str)", "dynamic=False"]),
    (torch.relu, {"rank": -1}, ValueError, ["rank must be None or an int >= 0, got -1", "get_rank()"]),
    (torch.relu, {"rank": "0"}, TypeError, ["rank must be None or an int >= 0, got '0' (str)", "as an int"]),
])
def test_cache_compile_refuses_bad_arguments_by_name(tmp_path: Path, fn: Any, kwargs: dict[str, Any],
                                                     error: type[Exception], words: list[str]) -> None:
    """Was: ``config=dict`` ended in an AttributeError, ``cache_compile(3)`` and a generator
    function were accepted (one warned later with a wrong fix, the other compiled and
    cached nothing, silently), ``rank=-1`` made a folder ``rank-1`` and ``dynamic="yes"``
    was accepted. Each now raises at the call of cache_compile, naming the argument, the
    value, what is allowed and the fix."""
    folder = tmp_path / "c"
    with pytest.raises(error) as info:
        graphgear.inference.cache_compile(fn, cache_dir=str(folder), **kwargs)
    text = str(info.value)
    assert text.startswith("graphgear.inference.cache_compile: ") and "Fix: " in text
    for w in words:
        assert w in text, text
    assert not folder.exists()

"""Collectives inside compiled and captured graphs, on torch.distributed (issue 13).

Every test starts 2 ranks with gloo on CPU (``torch.multiprocessing``'s spawn context,
127.0.0.1, a free port). Each rank runs a worker function of this module, compares its
results with eager PyTorch itself and writes what happened (a value, or the exception's
type, message, traceback and when it was raised) to a file the test reads. Every test is
bounded twice: the process group's timeout (``PG_TIMEOUT``, lower in the failure tests)
and a wall-clock limit on the processes, which are killed past it (the test then fails
saying which rank hung).
"""

from __future__ import annotations

import copy
import datetime
import os
import pickle
import socket
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import graphgear
from graphgear.bench import toy_decoder_tp
from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder

pytestmark = pytest.mark.distributed

WORLD = 2
PG_TIMEOUT = 30.0  # seconds: a collective that waits longer raises


# ------------------------------------------------------------------ the launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, port: int, out: str, pg_timeout: float, args: tuple) -> None:
    from graphgear.cache.store import use_private_inductor_cache

    use_private_inductor_cache()  # the tests' shared Inductor cache (conftest is not run here)
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_tensor's deprecation
    torch.set_num_threads(1)
    torch.manual_seed(0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    t0 = time.monotonic()
    try:
        result: dict[str, Any] = {"ok": True, "value": fn(rank, *args)}
    except BaseException as e:  # reported to the test, which decides
        result = {"ok": False, "type": type(e).__name__, "msg": str(e), "tb": traceback.format_exc()}
    result["seconds"] = time.monotonic() - t0
    tmp = Path(out) / f".rank{rank}.tmp"
    tmp.write_bytes(pickle.dumps(result))
    tmp.rename(Path(out) / f"rank{rank}.pkl")
    # a failed rank leaves at once: its peers must notice on their own, within the timeout
    if result["ok"]:
        dist.destroy_process_group()
    os._exit(0)


def run_ranks(fn: Callable[..., Any], tmp_path: Path, *args: Any, limit: float = 120.0,
              pg_timeout: float = PG_TIMEOUT, may_die: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """Run ``fn(rank, *args)`` on 2 gloo ranks; return each rank's result dict (``{"ok":
    False, "exitcode": ...}`` for a rank in ``may_die`` that wrote none). Kills the ranks
    and fails the test when one is still running after ``limit`` seconds."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, port, str(tmp_path), pg_timeout, args), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    if hung:
        pytest.fail(f"ranks {hung} still running after {limit:.0f} s (a hang): killed")
    results = []
    for r, p in enumerate(procs):
        f = tmp_path / f"rank{r}.pkl"
        if not f.exists() and r in may_die:
            results.append({"ok": False, "exitcode": p.exitcode})
            continue
        if not f.exists():
            pytest.fail(f"rank {r} exited with code {p.exitcode} and wrote no result")
        results.append(pickle.loads(f.read_bytes()))
    return results


def assert_all_ok(results: list[dict[str, Any]]) -> list[Any]:
    for r, res in enumerate(results):
        assert res["ok"], f"rank {r} raised {res['type']}: {res['msg']}\n{res['tb']}"
    return [res["value"] for res in results]


def _options(mode: str) -> dict[str, Any]:
    if mode == "eager":
        return {"debug.run_eagerly": True}
    return {"mode": mode}


MODES = ["max-autotune", "reduce-overhead", "eager"]


# ------------------------------------------------ 1. collectives inside one graph


def _collectives(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    import torch.distributed._functional_collectives as fc

    g = dist.group.WORLD
    a = fc.all_reduce(x * 2, "sum", g)
    b = fc.all_gather_tensor(x + 1, 0, g)
    c = fc.reduce_scatter_tensor(torch.cat([x, x * 3]), "sum", 0, g)
    d = fc.all_to_all_single(x.sin(), None, None, g)
    e = fc.broadcast(x - 1, 1, g)
    z = x.cos() + a
    dist.all_reduce(z)  # in-place c10d call: dynamo traces it into the functional one
    dist.all_reduce(y, op=dist.ReduceOp.MAX)  # in place on an input
    return a, b, c, d, e, z * 2


def _worker_collectives(rank: int) -> dict[str, int]:
    counts = {}
    for mode in MODES:
        graphgear.reset()
        torch._dynamo.reset()
        f = torch.compile(_collectives, backend="graphgear", options=_options(mode), fullgraph=True)
        for step in range(5):  # new values each step: a replay must run the collectives again
            x = torch.randn(4, 3) + rank * 10 + step
            y = torch.randn(4, 3) * (rank + 1)
            y_c = y.clone()
            want = _collectives(x, y)
            got = [t.clone() for t in f(x, y_c)]
            for i, (g, w) in enumerate(zip(got, want)):
                torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-5,
                                           msg=lambda m, i=i, s=step, md=mode: f"{md} step {s} output {i}: {m}")
            torch.testing.assert_close(y_c, y, rtol=0, atol=0, msg=lambda m, s=step, md=mode: f"{md} step {s} input y: {m}")
        rec = graphgear.stats().graphs
        assert len(rec) == 1, f"{mode}: {len(rec)} graphs, expected 1 (a graph break?)"
        if mode == "reduce-overhead":
            assert (rec[0].captures, rec[0].replays, rec[0].fallbacks) == (1, 3, []), graphgear.stats()
        counts[mode] = rec[0].compiles
    return counts


def test_collectives_inside_one_graph_equal_eager(tmp_path: Path) -> None:
    counts = assert_all_ok(run_ranks(_worker_collectives, tmp_path))
    assert counts[0] == counts[1] == {m: 1 for m in MODES}


def _inplace_c10d(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The in-place c10d calls dynamo 2.13 traces (``traceable_collective_remaps``) into
    functional collectives, point-to-point ones included (those need dynamo's
    ``enable_p2p_compilation``)."""
    peer = 1 - dist.get_rank()
    gathered = torch.empty(WORLD * x.shape[0], *x.shape[1:])
    dist.all_gather_into_tensor(gathered, x * 2)
    scattered = torch.empty(x.shape[0] // WORLD, *x.shape[1:])
    dist.reduce_scatter_tensor(scattered, x + 1)
    swapped = torch.empty_like(x)
    dist.all_to_all_single(swapped, x.sin())
    parts = [torch.empty_like(x) for _ in range(WORLD)]
    dist.all_gather(parts, x.cos())
    batched = torch.empty_like(x)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x - 1, peer), dist.P2POp(dist.irecv, batched, peer)]):
        work.wait()
    return gathered, scattered, swapped, torch.cat(parts), batched * 2


def _isend_irecv(x: torch.Tensor) -> torch.Tensor:
    """A separate isend and irecv: the aten graph keeps dynamo's order (both issued, then
    both waited), but Inductor's code waits for the isend before it issues the irecv, so
    with gloo (a send completes once the peer has posted its receive) both ranks block
    until the timeout, under ``torch.compile``'s own Inductor too. Only run eagerly here."""
    peer = 1 - dist.get_rank()
    received = torch.empty_like(x)
    for work in (dist.isend(x * 3, peer), dist.irecv(received, peer)):
        work.wait()
    return received + 1


def _broadcast_breaks(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    dist.broadcast(y, src=1)  # dynamo 2.13 does not trace it: a graph break, run eagerly
    return y + 1


def _worker_inplace_c10d(rank: int) -> dict[str, Any]:
    torch._dynamo.config.enable_p2p_compilation = True  # this process only
    out: dict[str, Any] = {}
    cases = [(_inplace_c10d, True, [4, 8], MODES), (_broadcast_breaks, False, None, MODES),
             (_isend_irecv, True, None, ["eager"])]
    for fn, full, gears, modes in cases:
        for mode in modes:
            graphgear.reset()
            torch._dynamo.reset()
            f = torch.compile(fn, backend="graphgear", options=_options(mode), fullgraph=full)
            sizes = (4, 8, 4, 8, 4, 8) if gears else (4,) * 5
            for step, n in enumerate(sizes):  # new values each step: a replay must run the collectives again
                x = torch.randn(n, 3) + rank * 10 + step
                if gears:
                    graphgear.set_dim_gears(x, {0: gears})
                want = fn(x)
                got = f(x)
                got = [t.clone() for t in got] if isinstance(got, tuple) else [got.clone()]
                want = list(want) if isinstance(want, tuple) else [want]
                for i, (g, w) in enumerate(zip(got, want, strict=True)):
                    torch.testing.assert_close(
                        g, w, rtol=1e-6, atol=1e-5,
                        msg=lambda m, i=i, s=step, md=mode, fn=fn: f"{fn.__name__} {md} step {s} output {i}: {m}")
            recs = graphgear.stats().graphs
            out[f"{fn.__name__} {mode}"] = {
                "graphs": len(recs), "captures": sum(r.captures for r in recs),
                "replays": sum(r.replays for r in recs), "fallbacks": [f for r in recs for f in r.fallbacks]}
    return out


def test_inplace_c10d_calls_inside_graphs_equal_eager(tmp_path: Path) -> None:
    """all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, all_gather and
    batch_isend_irecv in one graph (gears [4, 8] on the input), in every mode;
    ``dist.broadcast`` breaks the graph (dynamo cannot trace it) and runs eagerly between
    two graphs, both captured; a separate isend/irecv pair in ``debug.run_eagerly``."""
    r0, r1 = assert_all_ok(run_ranks(_worker_inplace_c10d, tmp_path))
    assert r0 == r1
    for key, v in r0.items():
        assert v["fallbacks"] == [], (key, v)
        fn, mode = key.split(" ")
        assert v["graphs"] == (2 if fn == "_broadcast_breaks" else 1), (key, v)
        if mode == "reduce-overhead":  # a warm-up, a capture, then replays, per gear / graph
            assert (v["captures"], v["replays"]) == ((2, 2) if fn == "_inplace_c10d" else (2, 6)), (key, v)


# ------------------------------------------------------- 2. gears across ranks


def _allreduce_mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as fc

    return fc.all_reduce(torch.relu(x @ w), "sum", dist.group.WORLD) + 1


def _worker_gears(rank: int, mode: str, bad_rank: int) -> dict[str, Any]:
    w = torch.randn(8, 8)
    f = torch.compile(_allreduce_mlp, backend="graphgear", options=_options(mode))
    for n in (2, 4, 2):  # every rank, the same gears: equal eager
        x = torch.randn(n, 8) + rank
        graphgear.set_dim_gears(x, {0: [2, 4]})
        torch.testing.assert_close(f(x, w).clone(), _allreduce_mlp(x, w))
    pg = dist.distributed_c10d._get_default_group()
    before = pg._get_sequence_number_for_group()
    dist.barrier()
    seq = pg._get_sequence_number_for_group()
    assert seq == before + 1, "gloo's sequence number does not count collectives"
    n = 3 if rank == bad_rank else 2
    x = torch.randn(n, 8)
    graphgear.set_dim_gears(x, {0: [2, 4]}) if n in (2, 4) else None
    t0 = time.monotonic()
    try:
        f(x, w)
    except graphgear.GearError as e:
        issued = pg._get_sequence_number_for_group() - seq
        # stay alive (as a server that caught the error would): the peer must time out
        time.sleep(PG_FAIL_TIMEOUT + 3)
        return {"raised": "GearError", "msg": str(e), "issued": issued}
    except Exception as e:  # the healthy rank: its all-reduce has no partner
        return {"raised": type(e).__name__, "msg": str(e), "seconds": time.monotonic() - t0}
    return {"raised": None, "seconds": time.monotonic() - t0}


PG_FAIL_TIMEOUT = 5.0


@pytest.mark.slow  # waits out the process-group timeout
@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead"])
def test_rank_outside_gears_raises_before_any_collective(tmp_path: Path, mode: str) -> None:
    results = run_ranks(_worker_gears, tmp_path, mode, 1, pg_timeout=PG_FAIL_TIMEOUT, limit=90)
    good, bad = assert_all_ok(results)
    assert bad["raised"] == "GearError", bad
    assert "3" in bad["msg"] and "[2, 4]" in bad["msg"], bad["msg"]
    assert bad["issued"] == 0, f"the failing call issued {bad['issued']} collective(s)"
    # the healthy rank waits in its all-reduce and gets the process group's timeout, not a hang
    assert good["raised"] in ("RuntimeError", "DistBackendError"), good
    assert "timed out" in good["msg"].lower() or "timeout" in good["msg"].lower(), good["msg"]
    assert PG_FAIL_TIMEOUT - 1 < good["seconds"] < PG_FAIL_TIMEOUT + 10, good["seconds"]


# ----------------------------------------- 3. tensor-parallel decoder over 2 ranks


def _worker_tp_decode(rank: int, mode: str, kind: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    # DTensor's sharding propagation makes tracing slow (AOTAutograd ~20 s a graph at 2
    # layers on a busy 2-core machine, all in torch): one layer for it
    cfg = DecoderConfig(max_batch_size=4, max_seq_len=32, num_layers=2 if kind == "megatron" else 1)
    ref = ToyDecoder(cfg).eval()  # the same seed on every rank: the same weights
    if kind == "megatron":
        tp = toy_decoder_tp.megatron(ref, rank, WORLD).eval()
    else:
        tp = toy_decoder_tp.dtensor(ref, init_device_mesh("cpu", (WORLD,))).eval()
    f = torch.compile(tp, backend="graphgear", options=_options(mode))
    gen = torch.Generator().manual_seed(1)  # the same tokens on every rank
    pos, worst = 0, 0.0
    vocab = slice(rank * cfg.vocab_size // WORLD, (rank + 1) * cfg.vocab_size // WORLD)
    with torch.no_grad():
        for bsz in (1, 2, 4, 2, 1):
            for _ in range(3):
                tokens = torch.randint(0, cfg.vocab_size, (bsz, 1), generator=gen)
                positions = torch.tensor([pos])
                want = ref(tokens, positions)
                graphgear.set_dim_gears(tokens, {0: [1, 2, 4]})
                out = f(tokens, positions)
                msg = lambda m, b=bsz, p=pos: f"batch {b} position {p}: {m}"  # noqa: E731
                if kind == "dtensor":  # the LM head's output: a DTensor sharded on the vocabulary
                    assert isinstance(out, DTensor) and out.placements == (Shard(2),), (type(out), out)
                    torch.testing.assert_close(out.to_local(), want[..., vocab], rtol=1e-5, atol=1e-5, msg=msg)
                    out = out.full_tensor()  # an all-gather, outside the graph
                got = out.clone()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=msg)
                worst = max(worst, float((got - want).abs().max()))
                pos += 1
        # the same size outside the gears on every rank: GearError on both, no collective
        pg = dist.distributed_c10d._get_default_group()
        seq = pg._get_sequence_number_for_group()
        tokens = torch.zeros(3, 1, dtype=torch.long)  # no set_dim_gears: 3 is not a gear
        try:
            f(tokens, torch.tensor([pos]))
            outside = "no error"
        except graphgear.GearError as e:
            outside = str(e)
        issued = pg._get_sequence_number_for_group() - seq
    for name, buf in ref.named_buffers():  # the caches: this rank's heads of the 1-rank ones
        if name.endswith("_cache"):
            heads = buf.shape[1] // WORLD
            torch.testing.assert_close(tp.get_buffer(name), buf[:, rank * heads:(rank + 1) * heads],
                                       rtol=1e-5, atol=1e-5)
    recs = graphgear.stats().graphs
    return {"graphs": len(recs), "compiles": sum(r.compiles for r in recs),
            "captures": sum(r.captures for r in recs), "replays": sum(r.replays for r in recs),
            "fallbacks": [f for r in recs for f in r.fallbacks], "gears": [r.gears for r in recs],
            "worst": worst, "outside": outside, "issued": issued}


@pytest.mark.parametrize(("kind", "mode"), [
    ("megatron", "reduce-overhead"), ("dtensor", "reduce-overhead"),
    # tracing the DTensor model twice more (about 2 min on a busy 2-core machine)
    pytest.param("dtensor", "max-autotune", marks=pytest.mark.slow)])
def test_tensor_parallel_decoder_equals_one_rank_eager(tmp_path: Path, kind: str, mode: str) -> None:
    """The toy decoder split by hand (functional and in-place all-reduces) or with
    ``torch.distributed.tensor.parallel`` (DTensor parameters, a vocabulary-parallel
    embedding, a DTensor output), gears [1, 2, 4]: every step's logits equal the 1-rank
    eager model's within 1e-5, and a batch outside the gears raises before any collective."""
    values = assert_all_ok(run_ranks(_worker_tp_decode, tmp_path, mode, kind, limit=180))
    for v in values:
        assert v["fallbacks"] == [], v
        # DTensor's shardability check guards the vocabulary-parallel embedding's batch
        # (``tokens.size()[0] < 2``, distributed/tensor/_ops/utils.py is_tensor_shardable),
        # so dynamo compiles batch 1 as a graph of its own; each graph has the gears
        assert v["graphs"] == (1 if kind == "megatron" else 2), v
        assert v["gears"] == [[(1,), (2,), (4,)]] * v["graphs"], v
        # one per gear on the CPU graph (reduce-overhead specialises each, "auto"
        # compile_sizes); max-autotune: one compile with dynamic sizes per graph
        assert v["compiles"] == (3 if mode == "reduce-overhead" else v["graphs"]), v
        if mode == "reduce-overhead":
            assert v["captures"] == 3, v  # one per gear
            assert v["replays"] == 15 - 3 - 3, v  # every call but a warm-up and a capture per gear
        assert "3" in v["outside"] and "[1, 2, 4]" in v["outside"], v["outside"]
        assert v["issued"] == 0, v


def _worker_hf_llama_dtensor(rank: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import StaticCache

    from tests.helpers import assert_close
    from tests.models import hf_llama

    mesh = init_device_mesh("cpu", (WORLD,))
    ref = hf_llama()  # the same seed on every rank: the same weights
    cfg = ref.config
    tp = copy.deepcopy(ref)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {k.removeprefix("layers.*."): styles[v]() for k, v in cfg.base_model_tp_plan.items()}
    for layer in tp.model.layers:  # transformers' own plan, applied with torch's classes
        parallelize_module(layer, mesh, plan)
    local = copy.deepcopy(cfg)  # the static cache holds this rank's heads
    local.head_dim = cfg.hidden_size // cfg.num_attention_heads
    local.num_attention_heads //= WORLD
    local.num_key_value_heads //= WORLD
    cache, ref_cache = StaticCache(config=local, max_cache_len=16), StaticCache(config=cfg, max_cache_len=16)
    f = torch.compile(tp, backend="graphgear", options=_options("reduce-overhead"))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in range(6):
            tok = torch.randint(0, cfg.vocab_size, (1, 1), generator=gen)
            pos = torch.tensor([[p]])
            got = f(input_ids=tok, cache=cache, position_ids=pos, use_cache=True).logits.clone()
            want = ref(input_ids=tok, cache=ref_cache, position_ids=pos, use_cache=True).logits
            assert_close(got, want, reduction=128, what=f"step {p} logits")
    recs = graphgear.stats().graphs
    return {"fallbacks": [f for r in recs for f in r.fallbacks], "captures": sum(r.captures for r in recs),
            "replays": sum(r.replays for r in recs)}


@pytest.mark.slow  # a transformers model
def test_hf_llama_dtensor_tensor_parallel_decode_equals_one_rank_eager(tmp_path: Path) -> None:
    """transformers' Llama (small config, random weights) split by its own
    ``base_model_tp_plan`` with torch's ColwiseParallel/RowwiseParallel, decoding with a
    StaticCache of this rank's heads in reduce-overhead: logits equal 1-rank eager."""
    values = assert_all_ok(run_ranks(_worker_hf_llama_dtensor, tmp_path, limit=300))
    for v in values:
        assert v["fallbacks"] == [], v
        # the cache's lazy initialisation makes a first graph; the next one is captured
        assert v["captures"] >= 1 and v["replays"] >= 3, v


# ------------------------------------------------------------------ 4. DDP training


class DDPNet(nn.Module):
    """A model class of the user's (dynamo skips frames of torch's own ``nn.Sequential``,
    which DDP's forward calls after its graph break in ``_pre_forward``)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3, self.l4 = (nn.Linear(16, 512), nn.Linear(512, 512), nn.Linear(512, 512),
                                              nn.Linear(512, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l4(torch.relu(self.l3(torch.tanh(self.l2(torch.relu(self.l1(x)))))))


def _worker_ddp(rank: int, mode: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.helpers import assert_close

    torch._dynamo.config.optimize_ddp = "ddp_optimizer"  # graphs split at bucket boundaries
    ref = DDPNet()  # the same seed on every rank: the same weights
    # 1 MB buckets (the DDP optimizer wants them no smaller than DDP's first bucket, 1 MB):
    # a 512x512 layer each, so the graph splits into several
    ddp = DDP(copy.deepcopy(ref), bucket_cap_mb=1)
    f = torch.compile(ddp, backend="graphgear", options=_options(mode))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(2)
    local = slice(rank * 4, (rank + 1) * 4)
    for step in range(3):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)  # the global batch
        loss = nn.functional.mse_loss(f(x[local]), y[local])
        loss.backward()
        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_loss.backward()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        assert_close(global_loss / WORLD, ref_loss, reduction=512, what=f"step {step} loss")
        for (name, p), (_, q) in zip(ddp.module.named_parameters(), ref.named_parameters()):
            assert p.grad is not None, f"step {step}: no gradient for {name}"
            assert_close(p.grad, q.grad, reduction=4096, what=f"step {step} grad of {name}")
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    recs = graphgear.stats().graphs
    return {"stages": [r.stage for r in recs], "fallbacks": [f for r in recs for f in r.fallbacks],
            "captures": sum(r.captures for r in recs), "replays": sum(r.replays for r in recs)}


@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead"])
def test_ddp_training_equals_single_process_eager(tmp_path: Path, mode: str) -> None:
    values = assert_all_ok(run_ranks(_worker_ddp, tmp_path, mode, limit=150))
    for v in values:
        assert v["fallbacks"] == [], v
        # the DDP optimizer split the model: several forward graphs, each with its backward
        assert v["stages"].count("forward") >= 2, v
        assert v["stages"].count("backward") == v["stages"].count("forward"), v
        if mode == "reduce-overhead":
            assert v["captures"] == len(v["stages"]), v  # every graph captured once...
            assert v["replays"] == len(v["stages"]), v  # ...and replayed at step 3
    assert values[0] == values[1]


# ------------------------------------------------------- 5. a rank that dies mid-run


def _worker_dies(rank: int, mode: str, die_at: int) -> dict[str, Any]:
    w = torch.randn(8, 8)
    f = torch.compile(_allreduce_mlp, backend="graphgear", options=_options(mode))
    for step in range(5):
        x = torch.randn(2, 8) + step
        if rank == 1 and step == die_at:
            os._exit(3)  # killed: no clean-up, no goodbye to the peer
        t0 = time.monotonic()
        try:
            got = f(x, w).clone()
        except Exception as e:
            return {"step": step, "raised": type(e).__name__, "msg": str(e), "seconds": time.monotonic() - t0}
        torch.testing.assert_close(got, _allreduce_mlp(x, w))
    return {"step": None}


@pytest.mark.parametrize(("mode", "die_at"), [("reduce-overhead", 1), ("reduce-overhead", 3),
                                              ("max-autotune", 2)],
                         ids=["at-capture", "at-replay", "max-autotune"])
def test_dead_rank_fails_the_other_within_the_timeout(tmp_path: Path, mode: str, die_at: int) -> None:
    results = run_ranks(_worker_dies, tmp_path, mode, die_at, pg_timeout=PG_FAIL_TIMEOUT, limit=90,
                        may_die=(1,))
    assert results[1] == {"ok": False, "exitcode": 3}, results[1]
    (alive,) = assert_all_ok(results[:1])
    assert alive["step"] == die_at, alive
    assert alive["raised"] in ("RuntimeError", "DistBackendError"), alive
    # gloo notices the closed connection at once, else the timeout fires
    assert any(w in alive["msg"].lower() for w in ("connection", "closed", "timed out", "timeout", "peer")), alive
    assert alive["seconds"] < PG_FAIL_TIMEOUT + 10, alive


def _worker_capture_fails(rank: int) -> dict[str, Any]:
    from graphgear.capture import cpu_graph

    original = cpu_graph.CPUGraph.capture
    failed = []

    def fails_once_after_running(self: Any, args: list[Any]) -> Any:
        outs = original(self, args)  # the collective has been issued
        if rank == 1 and not failed:
            failed.append(True)
            raise RuntimeError("capture failed on rank 1 only (simulated)")
        return outs

    cpu_graph.CPUGraph.capture = fails_once_after_running  # type: ignore[method-assign]
    w = torch.randn(8, 8)
    f = torch.compile(_allreduce_mlp, backend="graphgear", options=_options("reduce-overhead"))
    errors = []
    for step in range(5):
        x = torch.randn(2, 8) + step
        want = _allreduce_mlp(x, w)  # eager, on every rank at every step
        try:
            got = f(x, w).clone()
        except RuntimeError as e:
            errors.append((step, str(e)))
            continue
        torch.testing.assert_close(got, want, msg=lambda m, s=step: f"step {s}: {m}")
    seq = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
    (rec,) = graphgear.stats().graphs
    return {"errors": errors, "seq": seq, "captures": rec.captures, "replays": rec.replays}


def test_failed_capture_never_issues_a_collective_twice(tmp_path: Path) -> None:
    """The CPU graph's capture runs the graph (and its collectives). If it then fails on
    one rank, running the graph again uncaptured (the usual fallback) would issue that
    rank's collectives twice: the ranks would fall out of step. The error reaches the
    caller instead, and the next call captures again."""
    r0, r1 = assert_all_ok(run_ranks(_worker_capture_fails, tmp_path, pg_timeout=PG_FAIL_TIMEOUT, limit=90))
    assert r0["errors"] == [], r0
    assert r1["errors"] == [(1, "capture failed on rank 1 only (simulated)")], r1
    assert r0["seq"] == r1["seq"], (r0, r1)  # as many collectives on both ranks
    assert (r0["captures"], r0["replays"]) == (1, 3), r0
    assert (r1["captures"], r1["replays"]) == (1, 2), r1  # captured again at step 2

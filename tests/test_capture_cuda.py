"""reduce-overhead on CUDA (``torch.cuda.CUDAGraph``); skipped without a GPU.

``scripts/gpu_check.py`` runs this file and the decode benchmark on a lent GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphgear
from graphgear.capture import MemoryPool
from tests.helpers import assert_close
from tests.helpers import last_record as _rec
from tests.helpers import make_backend as _ro
from tests.models import CacheWriter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@torch.no_grad()
def test_cuda_decoder_decode_matches_eager_and_replays() -> None:
    from graphgear.bench.toy_decoder import ToyDecoder

    torch.manual_seed(0)
    model, ref = ToyDecoder().cuda().eval(), ToyDecoder().cuda().eval()
    ref.load_state_dict(model.state_dict())
    f = torch.compile(model, backend=_ro())
    tok = ref_tok = torch.tensor([[1]], device="cuda")
    for p in range(12):
        pos = torch.tensor([p], device="cuda")
        out = f(tok, pos)
        want = ref(ref_tok, pos)
        assert_close(out, want, reduction=1024)
        tok, ref_tok = out[:, -1:].argmax(-1), want[:, -1:].argmax(-1)
    assert_close(model.layers[0].attn.k_cache, ref.layers[0].attn.k_cache, reduction=512)
    r = _rec()
    assert (r.uncaptured_runs, r.captures, r.replays) == (1, 1, 10) and r.fallbacks == []
    assert r.pool_bytes > 0


@torch.no_grad()
def test_cuda_stale_output_raises_and_clone_output() -> None:
    net = nn.Linear(16, 16).cuda()
    f = torch.compile(net, backend=_ro(warmup_iters=1))
    x1, x2 = torch.randn(4, 16, device="cuda"), torch.randn(4, 16, device="cuda")
    f(x1)
    out1 = f(x1)
    out2 = f(x2)
    with pytest.raises(RuntimeError, match="overwritten"):
        out1 + 0
    assert_close(out2, net(x2), reduction=16)
    graphgear.reset()
    g = torch.compile(nn.Linear(16, 16).cuda(), backend=_ro(warmup_iters=1, clone_output=True))
    a, b, c = g(x1), g(x1), g(x2)
    assert_close(b, a)
    assert b.data_ptr() != c.data_ptr()


@torch.no_grad()
def test_cuda_custom_pool_shared_by_two_models() -> None:
    pool = MemoryPool()
    n1, n2 = nn.Linear(16, 16).cuda(), nn.Linear(16, 16).cuda()
    f1 = torch.compile(n1, backend=_ro(warmup_iters=1, use_custom_pool=pool))
    f2 = torch.compile(n2, backend=_ro(warmup_iters=1, use_custom_pool=pool))
    x = torch.randn(4, 16, device="cuda")
    for _ in range(3):
        f1(x)
        f2(x)
    assert pool.pool_id is not None
    assert_close(f1(x).clone(), n1(x), reduction=16)
    assert_close(f2(x).clone(), n2(x), reduction=16)


def test_cuda_training_gradients_equal_eager() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).cuda()
    ref = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).cuda()
    ref.load_state_dict(net.state_dict())
    f = torch.compile(net, backend=_ro(warmup_iters=1))
    for _ in range(4):
        x = torch.randn(8, 16, device="cuda")
        f(x).square().mean().backward()
        ref(x).square().mean().backward()
        for p, q in zip(net.parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, reduction=1024)
            p.grad = None
            q.grad = None
    assert _rec("forward").captures == 1 and _rec("backward").captures == 1


@pytest.mark.parametrize("make_view", [lambda t: t[:, -1], lambda t: t.t(), lambda t: t.view(-1)],
                         ids=["slice", "t", "view"])
def test_cuda_views_under_inference_mode_raise_when_stale(make_view) -> None:  # type: ignore[no-untyped-def]
    net = nn.Linear(16, 16).cuda()
    f = torch.compile(net, backend=_ro(warmup_iters=0))
    x1, x2 = torch.randn(2, 16, device="cuda"), torch.randn(2, 16, device="cuda")
    with torch.inference_mode():
        view = make_view(f(x1))
        torch.testing.assert_close(view, make_view(net(x1)))
        out = f(x2)
        with pytest.raises(RuntimeError, match="overwritten"):
            view + 0
        torch.testing.assert_close(out, net(x2))
        graphgear.reset()
        with pytest.raises(RuntimeError, match="overwritten|released"):
            out + 0


@torch.no_grad()
def test_cuda_threads_each_get_their_own_results() -> None:
    import threading

    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).cuda()
    f = torch.compile(net, backend=_ro())
    xs = [torch.randn(4, 16, device="cuda") + k for k in range(4)]
    wants = [net(x) for x in xs]
    f(xs[0])
    f(xs[0])  # compiled (and captured once) on the main thread first
    errors: list[str] = []
    barrier = threading.Barrier(4)

    def worker(k: int) -> None:
        try:
            barrier.wait()
            with torch.no_grad():
                for step in range(200):
                    out = f(xs[k])
                    if not torch.allclose(out, wants[k], atol=1e-5, rtol=1e-4):
                        errors.append(f"thread {k} step {step}: wrong result")
                        return
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:4]
    r = _rec()
    assert r.captures >= 5 and r.fallbacks == [], r


@torch.no_grad()
def test_cuda_moved_cache_is_recaptured_without_recompiling_and_dead_ones_released() -> None:
    import gc

    net = CacheWriter(16).cuda()
    f = torch.compile(net, backend=_ro())
    for _req in range(5):  # a fresh cache per request, as generate() makes
        cache, ref_cache = torch.zeros(8, 16, device="cuda"), torch.zeros(8, 16, device="cuda")
        for p in range(4):
            x, pos = torch.randn(1, 16, device="cuda"), torch.tensor([p], device="cuda")
            torch.testing.assert_close(f(x, pos, cache), net(x, pos, ref_cache))
        torch.testing.assert_close(cache, ref_cache)
        del cache
        gc.collect()
    r = _rec()
    assert r.compiles == 1 and r.captures == 5 and r.fallbacks == []
    from graphgear.capture.engine import CaptureEngine

    (eng,) = [o for o in gc.get_objects() if type(o) is CaptureEngine and o.record is r]
    assert sum(e.graph is not None for e in eng.entries.values()) <= 2  # dead caches released

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

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _ro(**capture: object) -> graphgear.backend.GraphgearBackend:
    config = graphgear.CompilerConfig()
    config.mode = "reduce-overhead"
    for k, v in capture.items():
        setattr(config.capture_config, k, v)
    return graphgear.get_backend(config)


def _rec(stage: str = "inference") -> graphgear.stats.GraphRecord:
    return [g for g in graphgear.stats().graphs if g.stage == stage][-1]


@torch.no_grad()
def test_cuda_decoder_decode_matches_eager_and_replays() -> None:
    from graphgear.toy_decoder import ToyDecoder

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

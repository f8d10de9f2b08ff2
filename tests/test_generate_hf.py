"""transformers ``generate()`` with a static cache and ``CompileConfig(backend="graphgear")``.

transformers compiles the model's ``__call__`` itself (on the CPU only with
``compile_config._compile_all_devices = True``) and builds a new ``StaticCache``, at new
addresses, for every request. Checked against eager: greedy and sampled tokens (batch 1
and 4, both modes); a moved cache never recompiles (the CPU graph rebinds it); captures
stay bounded and RSS flat over 200 requests; HF's own options (its default
``mode="reduce-overhead"`` keyword, ``options=``, ``fullgraph``, ``dynamic``) and varying
batch sizes through ``inference_config.input_gears``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch

import graphgear
from graphgear.errors import ConfigError, GearError, graphgear_error
from graphgear.inputs import input_name_matches

NEW = 16


def _qwen2(hidden: int = 256, layers: int = 4, vocab: int = 2048, seed: int = 0) -> torch.nn.Module:
    """The Qwen2 of issue 9 (hidden 256, 4 layers, vocab 2048), random weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                      max_position_embeddings=256, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).eval()


def _pair(**kw: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    model = _qwen2(**kw)
    ref = _qwen2(**kw)
    ref.load_state_dict(model.state_dict())
    return model, ref


def _cc(mode: str | None = None, *, cpu: bool = True, **kw: Any) -> Any:
    from transformers import CompileConfig

    if mode is not None:
        kw["options"] = {"mode": mode, **kw.get("options", {})}
        kw.setdefault("mode", None)
    cc = CompileConfig(backend="graphgear", **kw)
    if cpu:
        cc._compile_all_devices = True
    return cc


def _gen_kw(**kw: Any) -> dict[str, Any]:
    return dict(max_new_tokens=NEW, min_new_tokens=NEW, cache_implementation="static", pad_token_id=0, **kw)


_frames_base = [0]


def _frames() -> int:
    """Frames dynamo compiled since this test began."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"]) - _frames_base[0]


@pytest.fixture(autouse=True)
def _count_frames_from_here() -> None:
    _frames_base[0] = 0
    _frames_base[0] = _frames()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _graphs() -> list[graphgear.stats.GraphRecord]:
    return graphgear.stats().graphs


# ---- the option (no transformers needed) -----------------------------------------------

def test_input_gears_option_is_validated_with_clear_errors() -> None:
    config = graphgear.CompilerConfig()
    assert config.inference_config.input_gears == {}
    gears = {"input_ids": {0: [4, 1, 2, 2]}}
    config.inference_config.input_gears = gears
    assert config.inference_config.input_gears == {"input_ids": {0: [1, 2, 4]}}
    gears["input_ids"][0].append(8)  # the config holds its own copy
    assert config.inference_config.input_gears == {"input_ids": {0: [1, 2, 4]}}
    assert config.copy().inference_config.input_gears == {"input_ids": {0: [1, 2, 4]}}
    bad = [
        ([1, 2], "expected a dict"),
        ({"": {0: [1, 2]}}, "non-empty strings"),
        ({"x": [1, 2]}, "non-empty dict"),
        ({"x": {"0": [1, 2]}}, "a dim must be an int"),
        ({"x": {0: [0, 2]}}, "positive ints"),
        ({"x": {0: [2, 2]}}, "needs 2 to 100 distinct sizes, got 1"),
        ({"x": {0: list(range(1, 102))}}, "got 101"),
    ]
    for value, why in bad:
        with pytest.raises(ConfigError, match="inference_config.input_gears") as info:
            config.inference_config.input_gears = value
        assert why in str(info.value) and "{'input_ids': {0: [1, 2, 4]}}" in str(info.value)
    assert config.inference_config.input_gears == {"input_ids": {0: [1, 2, 4]}}  # unchanged
    # through torch.compile(options=...) by its leaf name
    from graphgear.config import apply_options

    apply_options(config, {"input_gears": {"x": {-1: (2, 3)}}})
    assert config.inference_config.input_gears == {"x": {-1: [2, 3]}}


def test_input_name_matching() -> None:
    assert input_name_matches("input_ids", "kwargs['input_ids']")
    assert input_name_matches("kwargs['input_ids']", "kwargs['input_ids']")
    assert input_name_matches("keys", "kwargs['cache'].layers[0].keys")
    assert input_name_matches("*keys", "kwargs['cache'].layers[3].keys")
    assert not input_name_matches("ids", "kwargs['input_ids']")
    assert not input_name_matches("keys", "kwargs['cache'].layers[0].values")
    assert not input_name_matches("input_ids", "kwargs['input_ids'].size()[0]")


def test_input_gears_on_a_plain_function_and_dim_out_of_range() -> None:
    config = graphgear.CompilerConfig()
    config.mode = "max-autotune"
    config.debug.run_eagerly = True  # the gears, not the code, are under test here
    config.inference_config.input_gears = {"x": {0: [2, 4]}}
    f = torch.compile(lambda x: x * 2, backend=graphgear.get_backend(config))
    for n in (2, 4):
        torch.testing.assert_close(f(torch.ones(n, 3)), torch.full((n, 3), 2.0))
    with pytest.raises(Exception) as info:
        f(torch.ones(3, 3))
    err = graphgear_error(info.value) or info.value
    assert isinstance(err, GearError) and "size 3" in str(err) and "[2, 4]" in str(err)
    graphgear.reset()
    config.inference_config.input_gears = {"x": {2: [2, 4]}}
    g = torch.compile(lambda x: x + 1, backend=graphgear.get_backend(config))
    with pytest.raises(Exception) as info:
        g(torch.ones(2, 3))
    err = graphgear_error(info.value)
    assert isinstance(err, GearError), info.value
    assert "names dim 2 of input 'x', which has 2 dims" in str(err)


# ---- generate() against eager -------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
@torch.no_grad()
def test_greedy_and_sampled_tokens_equal_eager(mode: str) -> None:
    model, ref = _pair()
    cc = _cc(mode)
    for batch in (1, 4):
        for r in range(3):  # request 1 compiles (and captures), later ones reuse it
            ids = torch.randint(2, 2048, (batch, 8))
            want = ref.generate(ids, do_sample=False, **_gen_kw())
            got = model.generate(ids, do_sample=False, compile_config=cc, **_gen_kw())
            assert torch.equal(got, want), (mode, batch, r)
            torch.manual_seed(100 + r)
            want = ref.generate(ids, do_sample=True, **_gen_kw())
            torch.manual_seed(100 + r)
            got = model.generate(ids, do_sample=True, compile_config=cc, **_gen_kw())
            assert torch.equal(got, want), (mode, batch, r, "sampling")
    graphs = _graphs()
    assert graphs and {g.mode for g in graphs} == {mode}
    assert all(not g.fallbacks for g in graphs), str(graphgear.stats())
    assert _frames() <= 2  # batch 1 static, batch 4 by dynamo's automatic dynamic
    if mode == "reduce-overhead":
        # one capture per graph key; every later request rebinds the new cache
        assert sum(g.captures for g in graphs) == 2 and sum(g.rebinds for g in graphs) >= 8
        assert sum(g.uncaptured_runs for g in graphs) == 2  # one warm-up per key


@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.parametrize("family", ["mistral", "gemma2"])
@torch.no_grad()
def test_sliding_window_models_compile_once_not_per_decode_position(family: str) -> None:
    """A sliding-window cache keeps its position as a Python int that every decode step
    advances (``cumulative_length_int``): dynamo makes it a SymInt input the graph only
    returns plus one. reduce-overhead compiled and captured a graph per position (23
    compiles over 10 Mistral requests, seconds each); no tensor depends on it, so one
    key serves every position. Tokens equal eager's, and requests after the first
    compile and capture nothing (Mistral's every layer slides: any prompt length; Gemma2's
    full-attention layers have a cache sized by the request: a new length is a new shape)."""
    import transformers as T

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, bos_token_id=1,
                  eos_token_id=None, pad_token_id=0, sliding_window=4)
    if family == "mistral":
        cfg, cls = T.MistralConfig(**common), T.MistralForCausalLM
    else:
        cfg, cls = T.Gemma2Config(head_dim=16, **common), T.Gemma2ForCausalLM
    torch.manual_seed(0)
    model, ref = cls(cfg).eval(), cls(cfg).eval()
    ref.load_state_dict(model.state_dict())
    cc = _cc("reduce-overhead")
    kw = dict(max_new_tokens=12, min_new_tokens=12, cache_implementation="static", pad_token_id=0)
    seen: set[int] = set()
    for r, length in enumerate((7, 7, 9, 13, 9)):
        ids = torch.randint(2, 256, (1, length))
        before = (sum(g.compiles for g in _graphs()), sum(g.captures for g in _graphs()))
        got = model.generate(ids, do_sample=False, compile_config=cc, **kw)
        assert torch.equal(got, ref.generate(ids, do_sample=False, **kw)), (family, r)
        if length in seen or (family == "mistral" and r):
            assert (sum(g.compiles for g in _graphs()), sum(g.captures for g in _graphs())) == before, \
                (length, str(graphgear.stats()))
        seen.add(length)
    per_length = 1 if family == "mistral" else len(seen)
    assert sum(g.captures for g in _graphs()) <= per_length + 1, str(graphgear.stats())


@pytest.mark.slow
@pytest.mark.inductor
@torch.no_grad()
def test_200_requests_bounded_captures_flat_rss() -> None:
    model, ref = _pair()
    cc = _cc("reduce-overhead")
    prompts = [torch.randint(2, 2048, (1, 8)) for _ in range(200)]
    rss: dict[int, float] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for r, ids in enumerate(prompts):
            out = model.generate(ids, do_sample=False, compile_config=cc, **_gen_kw())
            if r in (0, 99, 199):
                assert torch.equal(out, ref.generate(ids, do_sample=False, **_gen_kw())), r
            if r == 0:
                frames = _frames()
            if r in (50, 199):
                rss[r] = _rss_mb()
    assert not [w for w in caught if "capture_limit" in str(w.message)]
    assert _frames() == frames == 1  # no recompile after the first request
    graphs = _graphs()
    assert len(graphs) == 1 and graphs[0].compiles == 1, str(graphgear.stats())
    g = graphs[0]
    assert g.captures <= 2 and g.fallbacks == [], str(graphgear.stats())
    assert g.rebinds >= 199  # every request brings a new cache: rebound, not re-recorded
    assert g.replays == 200 * (NEW - 1) - 2  # all decode steps but the warm-up and capture
    assert rss[199] - rss[50] < 10, rss


@pytest.mark.slow
@pytest.mark.inductor
@torch.no_grad()
def test_hf_options_work_unchanged() -> None:
    from transformers import CompileConfig

    model, ref = _pair(hidden=64, layers=2, vocab=256)
    ids = torch.randint(2, 256, (1, 6))
    want = ref.generate(ids, do_sample=False, **_gen_kw())
    # HF's default: mode="reduce-overhead" reaches the backend as torch.compile's keyword
    cc = CompileConfig(backend="graphgear", fullgraph=True, dynamic=None)
    assert cc.mode == "reduce-overhead"
    cc._compile_all_devices = True
    for _ in range(3):
        assert torch.equal(model.generate(ids, do_sample=False, compile_config=cc, **_gen_kw()), want)
    assert [(g.mode, g.captures) for g in _graphs()] == [("reduce-overhead", 1)]
    # options= with graphgear options; mode=None leaves graphgear's mode to options
    graphgear.reset()
    model, ref = _pair(hidden=64, layers=2, vocab=256)
    cc = CompileConfig(backend="graphgear", mode=None, fullgraph=True,
                       options={"mode": "reduce-overhead", "capture_limit": 1, "warmup_iters": 0,
                                "experimental_config.frozen_parameter": True})
    cc._compile_all_devices = True
    for _ in range(2):
        assert torch.equal(model.generate(ids, do_sample=False, compile_config=cc, **_gen_kw()), want)
    g = _graphs()[-1]
    assert (g.captures, g.uncaptured_runs) == (1, 0)  # warmup_iters=0: captured on the first call
    # a backend object (HF deep-copies its CompileConfig, the backend with it)
    graphgear.reset()
    model, ref = _pair(hidden=64, layers=2, vocab=256)
    cfg = graphgear.CompilerConfig()
    cfg.mode = "reduce-overhead"
    cfg.experimental_config.frozen_parameter = True
    cc = CompileConfig(backend=graphgear.get_backend(cfg), mode=None, fullgraph=True)
    cc._compile_all_devices = True
    for _ in range(2):
        assert torch.equal(model.generate(ids, do_sample=False, compile_config=cc, **_gen_kw()), want)
    assert [(g.mode, g.captures) for g in _graphs()] == [("reduce-overhead", 1)]
    # a misspelt option fails with the name, the known options and nothing generated
    graphgear.reset()
    model, _ = _pair(hidden=64, layers=2, vocab=256)
    # (torch.compile takes mode= or options=, not both: HF's default mode must be None'd)
    cc = CompileConfig(backend="graphgear", mode=None, options={"capture_limt": 2})
    cc._compile_all_devices = True
    with pytest.raises(Exception) as info:
        model.generate(ids, do_sample=False, compile_config=cc, **_gen_kw())
    err = graphgear_error(info.value)
    assert isinstance(err, ConfigError) and "'capture_limt'" in str(err) and "capture_limit" in str(err)


@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
@torch.no_grad()
def test_input_gears_vary_the_batch_without_recompiles(mode: str) -> None:
    model, ref = _pair(hidden=64, layers=2, vocab=256)
    gears = [1, 2, 4]
    cc = _cc(mode, options={"input_gears": {"input_ids": {0: gears}}})
    kw = _gen_kw()

    def request(batch: int) -> None:
        ids = torch.randint(2, 256, (batch, 6))
        got = model.generate(ids, do_sample=False, compile_config=cc, **kw)
        assert torch.equal(got, ref.generate(ids, do_sample=False, **kw)), batch

    for batch in (2, 1, 4, 2):  # 1 after 2: size 1 must not get a graph of its own
        request(batch)
    assert _frames() == 2  # the first, static graph, then one dynamic graph for the gears
    geared = [g for g in _graphs() if g.gears]
    assert len(geared) == 1 and geared[0].gears == [(1,), (2,), (4,)], str(graphgear.stats())
    # the static graph of the first request, then one graph per gear
    assert sum(g.compiles for g in _graphs()) <= 1 + len(gears), str(graphgear.stats())
    built = sum(g.compiles + g.captures for g in _graphs())
    for batch in (4, 1, 2, 2, 1, 4):
        request(batch)
    assert _frames() == 2 and sum(g.compiles + g.captures for g in _graphs()) == built
    with pytest.raises(Exception) as info:  # a size outside the gears, before any work
        model.generate(torch.randint(2, 256, (3, 6)), compile_config=cc, **kw)
    err = graphgear_error(info.value) or info.value
    assert isinstance(err, GearError) and "size 3" in str(err) and "[1, 2, 4]" in str(err)


@pytest.mark.slow
@pytest.mark.inductor
@pytest.mark.parametrize("mode", ["serve", "reduce-overhead"])
@torch.no_grad()
def test_a_cache_reordered_between_steps_as_beam_search_does_equals_eager(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beam search reorders the cache between steps (``reorder_cache``: every layer's
    keys and values become new tensors, rows repeated or dropped); transformers 5 runs
    beam search uncompiled, so a server that compiles its own step meets this. The CPU
    graph rebinds the new tensors at every step: logits and caches equal eager's, no
    recompile, no recapture, and its kernel-call replay is re-pointed, not built again
    (a build per moved tensor made such a step 7x slower: 1513 vs 217 µs, tiny Qwen2)."""
    from transformers import StaticCache

    from graphgear.capture import cpu_graph

    builds = []
    build = cpu_graph._Program.build.__func__
    monkeypatch.setattr(cpu_graph._Program, "build",
                        classmethod(lambda cls, *a: builds.append(1) or build(cls, *a)))

    model, ref = _pair(hidden=128, layers=2)
    if mode == "serve":
        fn = graphgear.inference.serve(model)
    else:
        cfg = graphgear.CompilerConfig()
        cfg.mode = mode
        fn = torch.compile(model, backend=graphgear.get_backend(cfg))
    caches = [StaticCache(config=m.config, max_cache_len=32) for m in (model, ref)]
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(2, 2048, (3, 1), generator=g)
    steps = 10
    for step in range(steps):
        pos = torch.full((3, 1), step)
        got = fn(input_ids=tok, cache=caches[0], position_ids=pos, use_cache=True).logits
        want = ref(input_ids=tok, cache=caches[1], position_ids=pos, use_cache=True).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(caches[0].layers, caches[1].layers):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
        beam_idx = torch.tensor([step % 3, 0, 0]) if step % 2 else torch.randint(0, 3, (3,), generator=g)
        old = caches[0].layers[0].keys
        for c in caches:
            c.reorder_cache(beam_idx)
        assert caches[0].layers[0].keys is not old  # the graph's cache input moved
        tok = want[:, -1:].argmax(-1)
    graphs = _graphs()
    assert _frames() == 2  # the first step (cache not yet initialised) and the decode step
    assert sum(r.captures for r in graphs) == 1 and sum(r.recaptures for r in graphs) == 0
    assert sum(r.rebinds for r in graphs) == sum(r.replays for r in graphs) >= steps - 3
    assert len(builds) == 1  # at the capture only
    assert all(not r.fallbacks for r in graphs), str(graphgear.stats())


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.no_grad()
def test_cuda_generate_recaptures_without_recompiling() -> None:
    model, ref = _pair()
    model, ref = model.cuda(), ref.cuda()
    cc = _cc("reduce-overhead", cpu=False)  # transformers compiles on CUDA by itself
    for r in range(6):
        ids = torch.randint(2, 2048, (1, 8), device="cuda")
        want = ref.generate(ids, do_sample=False, **_gen_kw())
        assert torch.equal(model.generate(ids, do_sample=False, compile_config=cc, **_gen_kw()), want), r
    graphs = _graphs()
    assert _frames() == 1 and [g.compiles for g in graphs] == [1], str(graphgear.stats())
    g = graphs[0]
    # each request's cache lives at new addresses: a capture of the compiled code (no
    # re-trace), and the captures of dead caches are released
    assert g.captures == 1 + g.recaptures and g.fallbacks == []
    eng = [e for e in _engines() if e.record is g][0]
    assert len(eng.entries) <= 2


def _engines() -> list[Any]:
    import gc

    from graphgear.capture.engine import CaptureEngine

    return [o for o in gc.get_objects() if isinstance(o, CaptureEngine)]

"""TorchAir's npugraph_ex option names (issue 37): each one does in graphgear what it
names, checked by behaviour; options without effect in a mode warn once per backend;
combinations that cannot work raise ConfigError naming both."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Any

import pytest
import torch

import graphgear
from graphgear.capture import MemoryPool
from graphgear.config import CompilerConfig, _resolve_key, apply_options
from tests.helpers import assert_close
from tests.helpers import last_record as _rec
from tests.models import Net

#: every npugraph_ex name the issue lists, and the graphgear option it sets
TORCHAIR_NAMES = {
    "force_eager": "debug.run_eagerly",
    "use_graph_pool": "capture_config.use_custom_pool",
    "reuse_graph_pool_in_same_fx": "capture_config.reuse_pool_across_gears",
    "inplace_pass": "experimental_config.inplace_pass",
    "input_inplace_pass": "experimental_config.input_inplace_pass",
    "remove_cat_ops": "experimental_config.remove_cat_ops",
    "static_kernel_compile": "experimental_config.static_kernel_compile",
    "dump_tensor_data": "debug.data_dump.enabled",
    "capture_error_mode": "capture_config.capture_error_mode",
    "force_recapture": "capture_config.force_recapture",
    # TorchAir's dump options next to dump_tensor_data
    "data_dump_stage": "debug.data_dump.stage",
    "data_dump_dir": "debug.data_dump.path",
}


@pytest.mark.parametrize("name", sorted(TORCHAIR_NAMES))
def test_torchair_name_resolves(name: str) -> None:
    assert _resolve_key(name) == TORCHAIR_NAMES[name]


def test_section_aliases_as_attributes() -> None:
    c = CompilerConfig()
    c.debug.force_eager = True
    c.capture_config.reuse_graph_pool_in_same_fx = False
    pool = MemoryPool()
    c.capture_config.use_graph_pool = pool
    assert c.debug.run_eagerly is True and c.capture_config.reuse_pool_across_gears is False
    assert c.capture_config.use_custom_pool is pool
    # an alias is checked as its option is
    with pytest.raises(graphgear.ConfigError, match="capture_config.reuse_pool_across_gears"):
        c.capture_config.reuse_graph_pool_in_same_fx = 1
    with pytest.raises(graphgear.ConfigError, match="capture_error_mode.*'global', 'thread_local', 'relaxed'"):
        apply_options(CompilerConfig(), {"capture_error_mode": "strict"})


def _f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    a = x @ w
    b = torch.sin(x)
    c = torch.cat([a, b, x], dim=1)
    e = (c + 1) * 2
    return torch.cat([e.relu(), e.exp()], 0)


def test_force_eager_runs_the_graph_uncompiled() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    f = torch.compile(_f, backend="graphgear", options={"mode": "reduce-overhead", "force_eager": True})
    for _ in range(3):
        assert_close(f(x, w), _f(x, w), reduction=8)
    r = _rec()
    assert r.mode == "eager" and r.captures == 0 and r.replays == 0


def test_remove_cat_ops_writes_the_inputs_into_one_output() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: Any, config: Any) -> None:
        graphs.append(gm)

    f = torch.compile(_f, backend="graphgear", options={
        "force_eager": True, "remove_cat_ops": True, "post_grad_custom_post_pass": keep})
    assert_close(f(x, w), _f(x, w), reduction=8)
    assert_close(f(x * 2, w), _f(x * 2, w), reduction=8)
    assert _rec().passes["remove_cat_ops"] == 2
    (gm,) = graphs
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.cat.default not in targets
    assert torch.ops.aten.mm.out in targets and torch.ops.aten.sin.out in targets
    # off (the default): the cats stay
    graphgear.reset()
    torch.compiler.reset()
    f = torch.compile(_f, backend="graphgear", options={"force_eager": True})
    assert_close(f(x, w), _f(x, w), reduction=8)
    assert "remove_cat_ops" not in _rec().passes


def test_remove_cat_ops_copies_graph_inputs_into_their_slice() -> None:
    def g(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.cos(y), x * 3], dim=-1) - 1

    x, y = torch.randn(3, 2), torch.randn(3, 5)
    f = torch.compile(g, backend="graphgear", options={"force_eager": True, "remove_cat_ops": True})
    assert_close(f(x, y), g(x, y))
    assert _rec().passes["remove_cat_ops"] == 1


def test_inplace_pass_reuses_dead_intermediates() -> None:
    def g(x: torch.Tensor) -> torch.Tensor:
        a = x.sin()
        b = a * 2  # a is dead after this: mul_ on a
        return b.relu() + x

    x = torch.randn(16)
    f = torch.compile(g, backend="graphgear", options={"force_eager": True})
    assert_close(f(x), g(x))
    assert _rec().passes["reinplace_intermediates"] >= 2
    graphgear.reset()
    torch.compiler.reset()
    f = torch.compile(g, backend="graphgear", options={"force_eager": True, "inplace_pass": False})
    assert_close(f(x), g(x))
    assert "reinplace_intermediates" not in _rec().passes


class _SlotCache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.cache[: x.shape[0]]
        rows.add_(x)
        return rows * 2 + x


@pytest.mark.parametrize("input_inplace_pass", [True, False])
def test_inplace_pass_never_writes_a_view_of_an_input(input_inplace_pass: bool) -> None:
    """``rows = cache[:n]; rows.add_(x); return rows * 2 + x``: after ``reinplace_inputs``
    the ``slice`` for ``rows * 2`` reads the cache itself, but its fake value still looked
    like a fresh tensor, so ``inplace_pass`` made ``mul_`` and ``add_`` of it and the
    cache was written three times (silently wrong: 3 where eager has 1)."""
    model, ref = _SlotCache(), _SlotCache()
    f = torch.compile(model, backend="graphgear",
                      options={"force_eager": True, "input_inplace_pass": input_inplace_pass})
    with torch.no_grad():
        for n in (4, 4, 2):
            x = torch.randn(n, 4)
            assert_close(f(x), ref(x))
            assert_close(model.cache, ref.cache)


def test_input_inplace_pass_switches_the_kv_cache_write() -> None:
    def write(cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, pos, k)
        return cache.sum(0)

    for on in (True, False):
        graphgear.reset()
        torch.compiler.reset()
        cache, ref = torch.zeros(6, 4), torch.zeros(6, 4)
        f = torch.compile(write, backend="graphgear", options={"force_eager": True, "input_inplace_pass": on})
        for p in range(3):
            k = torch.randn(1, 4)
            assert_close(f(cache, torch.tensor([p]), k), write(ref, torch.tensor([p]), k))
            assert_close(cache, ref)
        assert ("reinplace_inputs" in _rec().passes and _rec().passes["reinplace_inputs"] >= 1) == on


@pytest.mark.inductor
@torch.no_grad()
def test_force_recapture_captures_every_call() -> None:
    net = Net()
    f = torch.compile(net, backend="graphgear", options={
        "mode": "reduce-overhead", "warmup_iters": 0, "force_recapture": True})
    for i in range(4):
        x = torch.randn(2, 8)
        assert_close(f(x), net(x), reduction=8)
        assert _rec().captures == i + 1
    r = _rec()
    assert r.replays == 0 and r.recaptures == 3
    # without it the same model replays its one capture
    graphgear.reset()
    torch.compiler.reset()
    f = torch.compile(net, backend="graphgear", options={"mode": "reduce-overhead", "warmup_iters": 0})
    for _ in range(4):
        f(torch.randn(2, 8))
    assert (_rec().captures, _rec().replays) == (1, 3)


@pytest.mark.inductor
@torch.no_grad()
def test_use_graph_pool_and_reuse_graph_pool_in_same_fx() -> None:
    from tests.test_capture import _engines

    net = Net()
    pool = MemoryPool()
    f = torch.compile(net, backend="graphgear", options={
        "mode": "reduce-overhead", "warmup_iters": 0, "use_graph_pool": pool})
    x = torch.randn(2, 8)
    assert_close(f(x), net(x), reduction=8)
    assert [e.pool for e in _engines()] == [pool] and pool.nbytes > 0
    graphgear.reset()
    torch.compiler.reset()
    f = torch.compile(net, backend="graphgear", dynamic=True, options={
        "mode": "reduce-overhead", "warmup_iters": 0, "reuse_graph_pool_in_same_fx": False})
    a = f(torch.randn(3, 8)).clone()
    f(torch.randn(5, 8))
    assert len({id(e.pool) for e in _engines()[-2:]}) == 2
    assert a.shape == (3, 8)


# ---- capture_error_mode: handed to torch.cuda.graph / torch.npu.graph ----------------------


@pytest.mark.parametrize("device", ["cuda", "npu"])
@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_capture_error_mode_reaches_the_device_capture(monkeypatch: pytest.MonkeyPatch, device: str,
                                                       mode: str) -> None:
    from graphgear.capture.cuda_graph import CUDAGraph
    from graphgear.capture.npu_graph import NPUGraph

    seen: dict[str, Any] = {}

    def graph(g: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return contextlib.nullcontext()

    if device == "cuda":
        monkeypatch.setattr(torch.cuda, "graph", graph)
    else:
        monkeypatch.setattr(torch, "npu", type("npu", (), {"graph": staticmethod(graph)}), raising=False)
    cls = CUDAGraph if device == "cuda" else NPUGraph
    g = cls(lambda a: a, pool=MemoryPool(), name="g", device=torch.device("cpu"), capture_error_mode=mode)
    with g._graph_ctx(object(), "pool", "stream"):
        pass
    assert seen == {"pool": "pool", "stream": "stream", "capture_error_mode": mode}


@torch.no_grad()
def test_capture_error_mode_from_options_to_the_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine builds its CUDA graphs with the config's mode (a CUDA graph faked on
    the CPU, as tests/test_capture.py's life-cycle test does)."""
    from graphgear.capture import devices, split
    from graphgear.compilers import reduce_overhead
    from tests.test_capture import _fake_cuda_graph_class

    fake = _fake_cuda_graph_class()
    modes: list[str] = []

    class Recording(fake):  # type: ignore[misc, valid-type]
        def _graph_ctx(self, graph: Any, pool: Any, stream: Any) -> Any:
            modes.append(self.capture_error_mode)
            return super()._graph_ctx(graph, pool, stream)

    monkeypatch.setattr(reduce_overhead, "graph_device", lambda inputs: torch.device("cuda"))
    monkeypatch.setattr(split, "find_uncapturable", lambda gm, device: [])  # CPU tensors in a "CUDA" graph
    monkeypatch.setattr(devices, "DEVICE_KINDS", {
        **devices.DEVICE_KINDS, "cuda": dataclasses.replace(devices.DEVICE_KINDS["cuda"], graph=Recording)})
    net = Net()
    f = torch.compile(net, backend="graphgear", options={
        "mode": "reduce-overhead", "capture_config.mode": "full", "warmup_iters": 0, "capture_error_mode": "global",
        "force_recapture": True, "use_graph_pool": MemoryPool(pool_id=(0, 1))})  # no device pool handle
    for _ in range(2):
        x = torch.randn(2, 8)
        assert_close(f(x), net(x), reduction=8)
    assert modes == ["global", "global"], (_rec().fallbacks, _rec().captures, _rec().mode)


# ---- per-mode warnings and combinations that cannot work ----------------------------------


def _idle_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "has no effect" in str(w.message)
            or "has no meaning" in str(w.message)]


def test_capture_option_under_eager_warns_once_per_backend() -> None:
    config = CompilerConfig()
    config.debug.run_eagerly = True
    config.capture_config.clone_output = True
    backend = graphgear.get_backend(config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = torch.compile(lambda x: x.sin() + 1, backend=backend)
        g = torch.compile(lambda x: x.cos() * 2, backend=backend)
        f(torch.randn(3))
        g(torch.randn(3))
        f(torch.randn(3))
    msgs = _idle_warnings(caught)
    assert msgs == ["graphgear: option capture_config.clone_output=True has no effect in mode eager "
                    "(debug.run_eagerly, TorchAir's force_eager): nothing is captured; set "
                    "mode='reduce-overhead' to capture."]
    # a second backend warns again: once per backend
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(lambda x: x.tan(), backend=graphgear.get_backend(config))(torch.randn(3))
    assert len(_idle_warnings(caught)) == 1


@pytest.mark.inductor
def test_capture_option_under_max_autotune_warns() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = torch.compile(lambda x: x + 1, backend="graphgear", options={"capture_limit": 4, "remove_cat_ops": True})
        assert_close(f(torch.ones(3)), torch.full((3,), 2.0))
    msgs = _idle_warnings(caught)
    assert any("capture_config.capture_limit=4" in m and "'max-autotune'" in m for m in msgs), msgs
    assert any("remove_cat_ops=True" in m and "Inductor" in m for m in msgs), msgs


def test_static_kernel_compile_is_accepted_with_one_warning() -> None:
    backend = graphgear.get_backend(CompilerConfig.from_dict({"debug.run_eagerly": True}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = torch.compile(lambda x: x * 3, backend=backend, options={"static_kernel_compile": True})
        for n in (2, 3, 4):  # three sizes, recompiles: still one warning
            assert_close(f(torch.ones(n)), torch.full((n,), 3.0))
    msgs = _idle_warnings(caught)
    assert len(msgs) == 1 and "static_kernel_compile=True has no meaning off the NPU (device cpu)" in msgs[0]


def test_data_dump_option_without_dump_warns() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = torch.compile(lambda x: x - 1, backend="graphgear",
                          options={"force_eager": True, "data_dump_stage": "original"})
        f(torch.ones(2))
    assert any("debug.data_dump.stage='original' has no effect while debug.data_dump.enabled is False" in m
               for m in _idle_warnings(caught))


def test_default_config_warns_nothing() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(lambda x: x - 1, backend="graphgear", options={"force_eager": True})(torch.ones(2))
    assert _idle_warnings(caught) == []


@pytest.mark.parametrize(("options", "names"), [
    ({"force_eager": True, "force_recapture": True}, ("force_recapture", "run_eagerly")),
    ({"dump_tensor_data": True, "force_recapture": True}, ("force_recapture", "data_dump.enabled")),
    ({"use_graph_pool": MemoryPool(), "reuse_graph_pool_in_same_fx": False},
     ("reuse_pool_across_gears", "use_custom_pool")),
])
def test_incompatible_combinations_raise(options: dict[str, Any], names: tuple[str, str]) -> None:
    config = apply_options(CompilerConfig(), options)
    with pytest.raises(graphgear.ConfigError) as e:
        graphgear.get_backend(config)
    assert all(n in str(e.value) for n in names), str(e.value)
    # and through torch.compile(options=...)
    f = torch.compile(lambda x: x + 1, backend="graphgear", options=options)
    with pytest.raises(Exception) as e2:
        f(torch.ones(2))
    err = graphgear.errors.graphgear_error(e2.value)
    assert isinstance(err, graphgear.ConfigError) and all(n in str(err) for n in names)


@torch.library.custom_op("gg_test43::bump", mutates_args=("y",))
def _bump(y: torch.Tensor) -> None:
    y.add_(1)


@pytest.mark.inductor
def test_inplace_pass_false_under_inductor_says_what_is_left_on() -> None:
    """The configuration reference said ``inplace_pass=False`` turns off Inductor's
    re-inplacing, and the warning said torch offers no switch for it; both were wrong:
    graphgear leaves Inductor's re-inplacing on (the option switches graphgear's own
    pass), and torch's switch exists. The warning names it, and the switch named does
    what it says (a mutated argument of a custom op gets a copy with it, none without)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    doc = CompilerConfig.option_paths()["experimental_config.inplace_pass"].doc
    assert "reinplace_intermediates" in doc and "graphgear leaves that on" in doc, doc

    def f(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        _bump(y)
        return y + 1

    x = torch.randn(16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = torch.compile(f, backend="graphgear", options={"inplace_pass": False})
        assert_close(g(x), x * 2 + 2)
    msgs = [m for m in _idle_warnings(caught) if "inplace_pass=False" in m]
    assert len(msgs) == 1 and "no switch" not in msgs[0], msgs
    switch = "disabled_passes='REINPLACE_INPLACEABLE_OPS'"
    assert switch in msgs[0], msgs[0]
    clones = []
    for disabled in ("", "REINPLACE_INPLACEABLE_OPS"):
        torch._dynamo.reset()
        with inductor_config.patch(disabled_passes=disabled, fx_graph_cache=False):
            out, (code,) = run_and_get_code(torch.compile(f), x)
        assert_close(out, x * 2 + 2)
        clones.append(code.count("clone"))
    assert clones[0] == 0 and clones[1] > 0, clones

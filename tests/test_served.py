"""graphgear.served.ServedModel: a served call runs dynamo's compiled code without
dynamo's frame evaluation exactly where dynamo would run that code, and goes through
dynamo otherwise; every answer equals eager's (and torch.compile's)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import graphgear
from graphgear.served import ServedModel
from tests.helpers import assert_close, run_threads


def _served(fn: Any, compiles: list[int] | None = None, **kw: Any) -> ServedModel:
    """``fn`` compiled by dynamo with a backend that counts its compiles (and runs the
    graph as it is), in its own isolate_recompiles region, as serve() compiles."""
    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        if compiles is not None:
            compiles.append(1)
        return gm.forward

    return ServedModel(torch.compile(fn, backend=backend, isolate_recompiles=True, **kw), fn)


def test_every_argument_form_binds_as_python_does() -> None:
    scale = torch.tensor(3.0)

    def fn(a, b=None, *rest, k=2.0, **extra):  # type: ignore[no-untyped-def]
        out = a * k * scale  # scale: a free variable (the closure)
        if b is not None:
            out = out + b
        for r in rest:
            out = out - r
        for v in extra.values():
            out = out * v
        return out

    f = _served(fn)
    x, y = torch.randn(3), torch.randn(3)
    calls = [((x,), {}), ((x, y), {}), ((x,), {"b": y}), ((x, y, x), {}), ((x,), {"k": 0.5}),
             ((x,), {"b": y, "z": y}), ((x, None, y, y), {"k": 1.5, "w": x})]
    for args, kwargs in calls:
        for _ in range(3):  # the first call of each form compiles, the next ones run direct
            assert_close(f(*args, **kwargs), fn(*args, **kwargs), reduction=1)
    assert f.direct_calls >= 2 * len(calls)
    with pytest.raises(TypeError):  # no binding: dynamo's path raises Python's error
        f(x, y, b=y)
    with pytest.raises(TypeError):
        f()


def test_a_guard_that_fails_compiles_again_and_later_calls_run_direct() -> None:
    compiles: list[int] = []

    class State:
        sign = 1.0

    state = State()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * state.sign

    f = _served(fn, compiles)
    x = torch.randn(4)

    def twice(arg: torch.Tensor, want: torch.Tensor) -> None:
        """The first call may compile; the second runs the entry it found, direct."""
        assert_close(f(arg), want, reduction=1)
        direct = f.direct_calls
        assert_close(f(arg), want, reduction=1)
        assert f.direct_calls == direct + 1

    twice(x, x)
    n = len(compiles)
    state.sign = -1.0  # a guarded Python value: no entry passes, dynamo compiles again
    twice(x, -x)
    assert len(compiles) == n + 1
    twice(x.double(), -x.double())  # a tensor guard (dtype)
    twice(torch.ones(2, 2), -torch.ones(2, 2))  # and its shape
    state.sign = 1.0
    twice(x, x)
    with torch.enable_grad():  # grad mode is a global-state guard
        w = torch.randn(4, requires_grad=True)
        f(w).sum().backward()
        assert_close(w.grad, torch.ones(4), reduction=1)


def test_calls_alternating_between_entries_each_run_their_own_code_direct() -> None:
    """The last direct call's entry is checked first; a call that fails its guards
    finds its own entry further down the list (a prefill / decode loop)."""
    compiles: list[int] = []
    f = _served(lambda x: x.sum(0) * 2, compiles)
    shapes = [(1, 4), (5, 4), (3, 2)]
    for s in shapes:  # one entry each
        f(torch.ones(s))
        f(torch.ones(s))
    n, direct = len(compiles), f.direct_calls
    for i in range(12):
        x = torch.randn(shapes[i % 3] if i % 4 else shapes[0])
        assert_close(f(x), x.sum(0) * 2, reduction=1)
    assert len(compiles) == n  # no recompile
    assert f.direct_calls == direct + 12


def test_served_code_records_no_profiler_ranges_and_leaves_dynamos_config_as_it_was() -> None:
    """dynamo's generated code calls two profiler-range functions on every call
    (``record_runtime_overhead``); a served model's code does not, and the option is
    set only around the served model's own compile."""
    from torch._dynamo import config as dynamo_config

    from graphgear._torch.dynamo import dynamo_entries, dynamo_region

    def names(compiled: Any, fn: Any) -> set[str]:
        (_, code), = dynamo_entries(fn.__code__, dynamo_region(compiled))
        return set(code.co_names)

    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    def g(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    before = (dynamo_config.record_runtime_overhead, dynamo_config.install_free_tensors)
    plain = torch.compile(g, backend="eager", isolate_recompiles=True)
    plain(torch.ones(3))
    assert "record_pregraph_bytecode_enter" in names(plain, g)  # this torch's default: the test can fail
    s = _served(f)
    x = torch.arange(3.0)
    assert_close(s(x), x * 2 + 1)
    assert_close(s(x + 1), x * 2 + 3)
    assert s.direct_calls == 1 and s.dynamo_calls == 1
    assert not {"record_pregraph_bytecode_enter", "record_pregraph_bytecode_exit"} & names(s._compiled, f)
    assert (dynamo_config.record_runtime_overhead, dynamo_config.install_free_tensors) == before


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


def test_module_hooks_run_and_the_modules_own_forward_is_called() -> None:
    net = _Net()
    f = _served(net)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            assert_close(f(x), net(x), reduction=4)
        direct = f.direct_calls
        assert direct >= 1
        h = net.register_forward_hook(lambda m, a, out: out * 0)
        assert (f(x) == 0).all()  # nn.Module.__call__ runs the hook: the direct path would not
        assert f.direct_calls == direct
        h.remove()
        assert_close(f(x), net(x), reduction=4)
        assert f.direct_calls == direct + 1
        net.forward = lambda t: t + 1  # an instance forward: not the compiled function
        assert_close(f(x), x + 1, reduction=1)
        assert f.direct_calls == direct + 1
    torch_module = _served(torch.nn.Linear(4, 4))  # dynamo wraps torch's own modules' call:
    for _ in range(3):  # there is no frame of theirs to run direct, so dynamo runs each call
        torch_module(x)
    assert torch_module.direct_calls == 0


def test_a_graph_break_goes_through_dynamo() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin()
        torch._dynamo.graph_break()
        return y.cos()

    f = _served(fn)
    x = torch.randn(5)
    for _ in range(3):
        assert_close(f(x), x.sin().cos(), reduction=1)
    assert f.direct_calls == 0 and f.dynamo_calls == 3


def test_stances_nested_compiles_and_reset_go_through_dynamo() -> None:
    compiles: list[int] = []
    f = _served(lambda x: x * 2, compiles)
    x = torch.randn(3)
    f(x)
    f(x)
    assert f.direct_calls == 1
    with torch.compiler.set_stance("force_eager"):
        assert_close(f(x), x * 2, reduction=1)
    outer = torch.compile(lambda t: f(t) + 1, backend="eager")
    assert_close(outer(x), x * 2 + 1, reduction=1)
    assert f.direct_calls == 1
    n = len(compiles)
    graphgear.reset()  # dynamo's caches cleared: the next call compiles again
    assert_close(f(x), x * 2, reduction=1)
    assert len(compiles) == n + 1 and f.direct_calls == 1
    f(x)
    assert f.direct_calls == 2


def test_a_captured_argument_cell_binds() -> None:
    def fn(x: torch.Tensor, n: int = 2) -> torch.Tensor:
        def inner() -> torch.Tensor:  # x and n are cells of fn's frame
            return x * n
        return inner() + 1

    f = _served(fn)
    x = torch.randn(3)
    for n in (2, 2, 3, 3):
        assert_close(f(x, n), x * n + 1, reduction=1)
    assert f.direct_calls >= 2


def test_threads_calling_one_direct_path_get_their_own_results() -> None:
    f = _served(lambda x, k: x * k)
    f(torch.ones(2), 1.0)

    def worker(i: int) -> None:
        for _ in range(200):
            x = torch.full((2,), float(i))
            out = f(x, 1.0)
            assert torch.equal(out, x), (i, out)

    run_threads(worker, 4)
    assert f.direct_calls > 400


@pytest.mark.inductor
@torch.no_grad()
def test_serve_runs_direct_and_direct_false_never_does() -> None:
    from graphgear.bench.toy_decoder import DecoderConfig, ToyDecoder

    cfg = DecoderConfig(vocab_size=64, hidden_size=32, num_layers=2, intermediate_size=64, max_seq_len=16)
    model, ref = ToyDecoder(cfg).eval(), ToyDecoder(cfg).eval()
    ref.load_state_dict(model.state_dict())
    f, g = graphgear.inference.serve(model), graphgear.inference.serve(ref, direct=False)
    assert isinstance(f, ServedModel) and f.layers is model.layers  # attributes are the model's
    tok = torch.tensor([[3]])
    for p in range(6):
        out, want = f(tok, torch.tensor([p])), g(tok, torch.tensor([p]))
        assert_close(out, want, reduction=64)
        assert_close(model.layers[0].attn.k_cache, ref.layers[0].attn.k_cache, reduction=64)
        tok = want[:, -1:].argmax(-1)
    assert f.direct_calls >= 4 and g.direct_calls == 0
    rec = graphgear.stats().graphs
    assert sum(r.captures for r in rec) == 2  # one capture each: the direct path replays it


@pytest.mark.inductor
@torch.no_grad()
def test_served_gears_run_direct_and_a_size_outside_them_raises_then_serving_goes_on() -> None:
    net = _Net().eval()
    f = graphgear.inference.serve(net)

    def call(n: int) -> torch.Tensor:
        x = torch.randn(n, 4)
        graphgear.set_dim_gears(x, {0: [1, 2, 4]})
        out = f(x)
        assert_close(out, net(x), reduction=4)
        return out

    for n in (1, 2, 4, 2, 1, 4, 4):
        call(n)
    direct = f.direct_calls
    assert direct >= 4  # one dynamo entry for every gear: the later calls run direct
    with pytest.raises(graphgear.GearError, match="3"):
        call(3)  # outside the gears: the compiled code raises, through the direct path too
    call(2)
    assert f.direct_calls > direct


@pytest.mark.slow
@pytest.mark.inductor
@torch.no_grad()
def test_threads_decode_one_served_transformers_model_each_with_its_cache() -> None:
    """Three threads decode with one served Qwen2 (direct path, graphgear's attention
    kernel, one CPU graph per thread), each its own StaticCache and prompt: every
    thread's logits and cache equal eager's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, StaticCache

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    model, ref = Qwen2ForCausalLM(cfg).eval(), Qwen2ForCausalLM(cfg).eval()
    ref.load_state_dict(model.state_dict())
    f = graphgear.inference.serve(model)
    start = threading.Barrier(3)
    results: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}

    def decode(fn: Any, first: int, wait: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        cache = StaticCache(config=cfg, max_cache_len=16)
        tok, outs = torch.tensor([[first]]), []
        if wait:
            start.wait()
        for p in range(6):
            out = fn(input_ids=tok, cache=cache, position_ids=torch.tensor([[p]]), use_cache=True).logits
            outs.append(out.clone())
            tok = out[:, -1:].argmax(-1)
        return outs, cache.layers[1].keys.clone()

    def worker(i: int) -> None:
        with torch.no_grad():  # grad mode is per thread
            results[i] = decode(f, 5 + i, True)

    decode(f, 3, False)  # compile first: the threads then run the compiled code at once
    run_threads(worker, 3)
    for i in range(3):
        want, want_keys = decode(ref, 5 + i, False)
        got, keys = results[i]
        for g, w in zip(got, want):
            assert_close(g, w, reduction=128)
        assert_close(keys, want_keys, reduction=64)
    assert f.direct_calls >= 3 * 5


class _TwoLayers(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.inductor
@torch.no_grad()
def test_weights_loaded_into_a_served_model_are_served_at_every_batch_size() -> None:
    """``load_state_dict`` after serve(): the frozen code holds the old weights (packed
    copies at 2 to 16 rows, the parameters' own memory at one row), so serving on would
    mix old and new weights by batch size. The next call compiles the model again:
    every batch size, those seen before and a new one, computes with the new weights;
    loading into a submodule counts too."""
    model = _TwoLayers(0).eval()
    f = graphgear.inference.serve(model)
    for rows in (1, 1, 1, 2, 2, 2):
        x = torch.randn(rows, 64)
        assert_close(f(x), model(x), reduction=64)
    model.load_state_dict(_TwoLayers(1).state_dict())
    for rows in (1, 2, 4, 4, 2, 1):
        x = torch.randn(rows, 64)
        assert_close(f(x), model(x), reduction=64, what=f"{rows} rows after load_state_dict")
    assert f.reserves == 1
    model.b.load_state_dict(_TwoLayers(2).b.state_dict())
    for rows in (2, 2, 1):
        x = torch.randn(rows, 64)
        assert_close(f(x), model(x), reduction=64, what=f"{rows} rows after a submodule's load")
    assert f.reserves == 2
    # through the served model: the model's own keys (torch.compile's wrapper wants them
    # prefixed with "_orig_mod.")
    assert list(f.state_dict()) == list(model.state_dict())
    f.load_state_dict(_TwoLayers(3).state_dict())
    for rows in (1, 2):
        x = torch.randn(rows, 64)
        assert_close(f(x), _TwoLayers(3)(x), reduction=64, what=f"{rows} rows after the served model's load")
    assert f.reserves == 3


@pytest.mark.inductor
@torch.no_grad()
def test_a_deep_copy_of_a_served_model_serves_the_copy() -> None:
    """copy.deepcopy of a served model serves a deep copy of the model (its own compile):
    weights loaded into the copy are the copy's; the original keeps its own, and is not
    compiled again for the copy's load."""
    import copy

    model = _TwoLayers(0).eval()
    f = graphgear.inference.serve(model)
    x = torch.randn(2, 64)
    for _ in range(3):
        f(x)
    g = copy.deepcopy(f)
    assert isinstance(g, ServedModel) and g._orig_mod is not model
    g._orig_mod.load_state_dict(_TwoLayers(1).state_dict())
    for _ in range(3):
        assert_close(g(x), g._orig_mod(x), reduction=64, what="the copy")
        assert_close(f(x), model(x), reduction=64, what="the original")
    assert f.reserves == 0
    with pytest.raises(TypeError, match="deep-copy the model and serve the copy"):
        copy.deepcopy(_served(lambda t: t + 1))


@pytest.mark.inductor
@torch.no_grad()
def test_frozen_weights_loaded_then_reset_are_seen_at_every_batch_size() -> None:
    """frozen_parameter through torch.compile (not serve): after load_state_dict and
    graphgear.reset(), every gear compiles again from the loaded weights; the packed
    copies made from the old ones are not handed out again (the store knows a weight by
    its version too)."""
    from tests.helpers import make_config

    model = _TwoLayers(0).eval()
    f = torch.compile(model, backend=graphgear.get_backend(make_config(warmup_iters=0, frozen_parameter=True)))
    for rows in (1, 2, 4):
        x = torch.randn(rows, 64)
        assert_close(f(x), model(x), reduction=64)
    model.load_state_dict(_TwoLayers(1).state_dict())
    graphgear.reset()
    for rows in (4, 2, 1, 8):
        x = torch.randn(rows, 64)
        assert_close(f(x), model(x), reduction=64, what=f"{rows} rows after load_state_dict and reset")


@pytest.mark.inductor
@torch.no_grad()
def test_frozen_weights_written_in_place_are_seen_at_every_batch_size_without_reset() -> None:
    """frozen_parameter through torch.compile (transformers' CompileConfig takes this
    path): weights loaded or updated in place after the first calls were seen at one row
    (its code reads the parameters' memory) and not at 2 to 16 rows (packed copies):
    silently wrong by batch size. The frozen code now follows the parameters' version
    counters: every batch size computes with the new weights, and calls in between that
    write nothing compile nothing."""
    from tests.helpers import make_config

    model = _TwoLayers(0).eval()
    f = torch.compile(model, backend=graphgear.get_backend(make_config(frozen_parameter=True)))
    for rows in (1, 2, 4) * 3:
        x = torch.randn(rows, 64)
        assert_close(f(x), model(x), reduction=64)
    compiles = sum(g.compiles for g in graphgear.stats().graphs)
    captures = sum(g.captures for g in graphgear.stats().graphs)
    for rows in (1, 2, 4) * 2:  # steady: nothing compiled or captured again
        f(torch.randn(rows, 64))
    assert sum(g.captures for g in graphgear.stats().graphs) == captures
    model.load_state_dict(_TwoLayers(1).state_dict())
    for rows in (2, 4, 1, 2, 4, 1, 2, 4, 1):
        x = torch.randn(rows, 64)
        assert_close(f(x), model(x), reduction=64, what=f"{rows} rows after load_state_dict")
    model.b.weight.mul_(0.5)  # an in-place update of one weight
    for rows in (4, 2, 1) * 3:
        x = torch.randn(rows, 64)
        assert_close(f(x), model(x), reduction=64, what=f"{rows} rows after an in-place update")
    assert sum(g.compiles for g in graphgear.stats().graphs) == compiles  # no new graph key


class _Offset(_TwoLayers):
    """A buffer the caller writes between calls (a position counter): a static input."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.register_buffer("shift", torch.zeros(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shift


@pytest.mark.inductor
@torch.no_grad()
def test_a_buffer_written_between_calls_stays_an_input_of_frozen_code() -> None:
    """Frozen code holds the parameters' values only: a buffer written between calls is
    read as it is at every batch size, and writing it compiles and captures nothing."""
    from tests.helpers import make_config

    model = _Offset(0).eval()
    f = torch.compile(model, backend=graphgear.get_backend(make_config(frozen_parameter=True)))
    for rows in (1, 2, 4) * 3:
        f(torch.randn(rows, 64))
    captures = sum(g.captures for g in graphgear.stats().graphs)
    for step in range(6):
        model.shift.add_(1.0)
        for rows in (1, 2, 4):
            x = torch.randn(rows, 64)
            assert_close(f(x), model(x), reduction=64, what=f"step {step}, {rows} rows")
    assert sum(g.captures for g in graphgear.stats().graphs) == captures


@pytest.mark.inductor
@torch.no_grad()
def test_a_served_model_deleted_and_reset_frees_its_weights() -> None:
    """The frozen code of every gear holds the weights (and packed copies of them);
    Inductor keeps each module it loads with constants for the life of the process
    unless told otherwise. A served model deleted, then graphgear.reset(): nothing
    holds its weights' memory any more."""
    import gc

    from torch.multiprocessing.reductions import StorageWeakRef

    model = _TwoLayers(0).eval()
    f = graphgear.inference.serve(model)
    for rows in (1, 1, 2, 2, 4, 4):
        f(torch.randn(rows, 64))
    weights = [StorageWeakRef(p.untyped_storage()) for p in model.parameters()]
    del f, model
    graphgear.reset()
    gc.collect()
    assert all(w.expired() for w in weights), [w.expired() for w in weights]


@pytest.mark.slow
@pytest.mark.inductor
@torch.no_grad()
def test_served_decoder_serves_request_after_request_each_with_a_new_static_cache() -> None:
    """A server that makes a new StaticCache per request and decodes with the served
    model from its first step: the cache's tensors are created by the compiled graph
    itself (StaticCache initialises on its first update), so they are outputs of a graph
    of the pool, fed back to the decode graph to be updated in place, and the next
    request's first step overwrites the previous cache. Every request decodes as eager
    does (the third one used to raise the stale-output error from graphgear's own check
    of the previous request's cache), with one capture per graph."""
    from transformers import StaticCache

    from tests.models import hf_qwen2_pair

    cfg, model, ref = hf_qwen2_pair()
    f = graphgear.inference.serve(model)
    for req in range(3):
        cache, ref_cache = StaticCache(config=cfg, max_cache_len=16), StaticCache(config=cfg, max_cache_len=16)
        tok = torch.randint(3, 100, (2, 1), generator=torch.Generator().manual_seed(req))
        for p in range(5):
            pos = torch.full((2, 1), p)
            out = f(input_ids=tok, cache=cache, position_ids=pos, use_cache=True).logits
            want = ref(input_ids=tok, cache=ref_cache, position_ids=pos, use_cache=True).logits
            assert_close(out, want, reduction=128, what=f"request {req}, step {p}")
            tok = want[:, -1:].argmax(-1)
        for layer, ref_layer in zip(cache.layers, ref_cache.layers):
            assert_close(layer.keys, ref_layer.keys, reduction=64, what=f"request {req}: keys")
    assert [g.captures for g in graphgear.stats().graphs] == [1, 1]


@torch.no_grad()
def test_a_served_models_module_still_saves_and_loads() -> None:
    """serve() puts a load_state_dict hook on the model's modules; the model still saves
    whole (``torch.save(model)``, pickle) and the loaded copy takes a state dict, its
    hook doing nothing."""
    import io
    import pickle

    model = _TwoLayers(0).eval()
    graphgear.inference.serve(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    copy_ = pickle.loads(pickle.dumps(model))
    copy_.load_state_dict(_TwoLayers(1).state_dict())
    x = torch.randn(2, 64)
    assert_close(copy_(x), _TwoLayers(1)(x), reduction=64)

"""Gears: validation, merge policies, out-of-gear errors, padding, no recompiles,
precompilation; on an MLP, the embedded decoder and a transformers Llama."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import graphgear
from graphgear import GearError
from tests.helpers import assert_close, make_backend
from tests.models import MLP, hf_llama, small_decoder

MODES = ["eager", "max-autotune", "reduce-overhead"]


def geared(x: torch.Tensor, gears: dict[int, list[int]]) -> torch.Tensor:
    graphgear.set_dim_gears(x, gears)
    return x


# ----------------------------------------------------------------- set_dim_gears input


@pytest.mark.parametrize("gears, rule", [
    ({"0": [1, 2]}, "dim must be an int"),
    ({2: [1, 2]}, "out of range"),
    ({-3: [1, 2]}, "out of range"),
    ({0: 4}, "list or tuple of positive ints"),
    ({0: [1, 0]}, "list or tuple of positive ints"),
    ({0: [1, 2.0]}, "list or tuple of positive ints"),
    ({0: [True, 2]}, "list or tuple of positive ints"),
    ({0: [4]}, "2 to 100 distinct sizes"),
    ({0: [3, 3]}, "2 to 100 distinct sizes"),
    ({0: list(range(1, 102))}, "2 to 100 distinct sizes"),
    ({}, "non-empty dict"),
])
def test_set_dim_gears_rejects(gears, rule: str) -> None:
    x = torch.randn(4, 8)
    with pytest.raises(GearError, match=rule):
        graphgear.set_dim_gears(x, gears)
    assert isinstance(GearError("x"), ValueError)


def test_set_dim_gears_again() -> None:
    x = torch.randn(4, 8)
    graphgear.inference.set_dim_gears(x, {0: [2, 4]})
    graphgear.set_dim_gears(x, {0: (4, 2)})  # the same gears again: fine
    graphgear.set_dim_gears(x, {1: [8, 16]})  # another dim: fine
    assert graphgear.gears.get_dim_gears(x) == {0: [2, 4], 1: [8, 16]}
    with pytest.raises(GearError, match=r"already has gears \[2, 4\]"):
        graphgear.set_dim_gears(x, {0: [2, 8]})
    with pytest.raises(GearError, match="expected a torch.Tensor"):
        graphgear.set_dim_gears([1, 2], {0: [1, 2]})


# --------------------------------------------------------------------------- MLP


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("compile_sizes", [(), "all"])
def test_one_graph_per_gear_no_recompiles(mode: str, compile_sizes) -> None:
    # default: one compile with dynamic sizes serves every gear (reduce-overhead: a
    # capture each); compile_sizes="all": one specialised compile per gear
    model = MLP().eval()
    compiled = torch.compile(model, backend=make_backend(mode, compile_sizes=compile_sizes))
    counters.clear()
    with torch.no_grad():
        for n in [4, 1, 2, 8, 2, 4, 1]:
            x = geared(torch.randn(n, 16), {0: [1, 2, 4, 8]})
            assert_close(compiled(x), model(x), reduction=32)
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["recompiles"].values()) == 0 if "recompiles" in counters else True
    (g,) = graphgear.stats().graphs
    assert g.gears == [(1,), (2,), (4,), (8,)]
    assert g.compiles == (1 if mode == "eager" or compile_sizes == () else 4)
    if mode == "reduce-overhead":  # a warm-up run, then a capture, per gear seen twice
        assert (g.uncaptured_runs, g.captures, g.replays) == (4, 3, 0)


@pytest.mark.parametrize("mode", MODES)
def test_size_outside_gears_raises_and_model_stays_usable(mode: str) -> None:
    model = MLP().eval()
    compiled = torch.compile(model, backend=make_backend(mode))
    with torch.no_grad():
        compiled(geared(torch.randn(2, 16), {0: [2, 4, 8]}))
        for bad in (3, 16):
            with pytest.raises(GearError) as e:
                compiled(geared(torch.randn(bad, 16), {0: [2, 4, 8]}))
            msg = str(e.value)
            assert f"size {bad} at dim 0" in msg and "[2, 4, 8]" in msg and "input 'x'" in msg
        x = geared(torch.randn(4, 16), {0: [2, 4, 8]})
        assert_close(compiled(x), model(x), reduction=32)


@pytest.mark.parametrize("mode", MODES)
def test_padding_to_next_gear(mode: str) -> None:
    model = MLP().eval()
    compiled = torch.compile(model, backend=make_backend(mode, gear_padding=True))
    with torch.no_grad():
        for n in [3, 5, 1, 7, 8]:
            x = geared(torch.randn(n, 16), {0: [2, 4, 8]})
            out = compiled(x)
            assert out.shape == (n, 8)
            assert_close(out, model(x), reduction=32)
        with pytest.raises(GearError, match="above the largest gear"):
            compiled(geared(torch.randn(9, 16), {0: [2, 4, 8]}))
    (g,) = graphgear.stats().graphs
    # one compile with dynamic sizes serves every gear; the CPU graph compiles each gear
    assert g.compiles == (3 if mode == "reduce-overhead" else 1)


class _TokenMLP(torch.nn.Module):
    """Per-token layers over [batch, seq, 8]: rows (and tokens) do not mix, as padding assumes."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)) * x.sum(-1, keepdim=True))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dim", [0, 1])
def test_padding_in_training_gives_eager_gradients(mode: str, dim: int) -> None:
    """A training forward run padded hands its backward the saved activations and sizes
    at the real size (the backward crashed on the gear's sizes: 8 vs 5). Padding the
    sequence dim leaves inner-dim slices, restrided to what the backward was traced with."""
    torch.manual_seed(0)
    model = _TokenMLP()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=make_backend(mode, gear_padding=True))
    for n in [8, 8, 5, 3, 5, 4]:
        shape = [2, 3, 8]
        shape[dim] = n
        x = torch.randn(shape)
        t = torch.randn(shape[:2] + [4])
        out = compiled(geared(x, {dim: [2, 4, 8]}))
        expected = ref(x)
        assert out.shape == expected.shape
        assert_close(out, expected, reduction=32)
        ((out - t) ** 2).mean().backward()
        ((expected - t) ** 2).mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, reduction=64, what=f"size {n}: {name}")
        model.zero_grad()
        ref.zero_grad()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead"])
def test_hf_llama_training_with_sequence_gears_and_padding(mode: str) -> None:
    """A transformers Llama trained on sequences padded to the next gear (causal: the
    real tokens never see the padded ones): logits and every gradient equal eager's."""
    torch.manual_seed(0)
    model = hf_llama().train()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=make_backend(mode, gear_padding=True))
    for n in [8, 5, 3, 6]:
        ids = geared(torch.randint(1, 128, (2, n)), {1: [4, 8]})
        out, expected = compiled(input_ids=ids).logits, ref(input_ids=ids).logits
        assert_close(out, expected, reduction=256)
        out.square().mean().backward()
        expected.square().mean().backward()
        top = max(float(q.grad.abs().max()) for q in ref.parameters())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, reduction=1024, scale=top, what=f"length {n}: {name}")
        model.zero_grad()
        ref.zero_grad()


def _two_dim_fn(x: torch.Tensor) -> torch.Tensor:
    return (x.softmax(-1) * 2).sum(-1, keepdim=True) + x.mean(0, keepdim=True)


@pytest.mark.parametrize("policy, ok, bad", [
    ("zip", [(2, 8), (4, 16)], [(2, 16), (4, 8)]),
    ("product", [(2, 8), (4, 16), (2, 16), (4, 8)], [(3, 8)]),
])
def test_merge_policies(policy: str, ok, bad) -> None:
    compiled = torch.compile(_two_dim_fn, backend=make_backend("eager", dynamic_gears_merge_policy=policy))
    for b, s in ok:
        x = geared(torch.randn(b, s), {0: [2, 4], 1: [8, 16]})
        assert_close(compiled(x), _two_dim_fn(x), reduction=16)
    for b, s in bad:
        with pytest.raises(GearError):
            compiled(geared(torch.randn(b, s), {0: [2, 4], 1: [8, 16]}))
    (g,) = graphgear.stats().graphs
    assert len(g.gears) == len(ok)


def test_zip_of_unequal_lists_is_an_error() -> None:
    compiled = torch.compile(_two_dim_fn, backend=make_backend("eager"))
    x = geared(torch.randn(2, 8), {0: [2, 4], 1: [8, 16, 32]})
    with pytest.raises(Exception) as e:
        compiled(x)
    err = graphgear.errors.graphgear_error(e.value)
    assert isinstance(err, GearError) and "equal length" in str(err) and "'product'" in str(err)


def test_more_than_100_combinations_is_an_error() -> None:
    compiled = torch.compile(_two_dim_fn, backend=make_backend("eager", dynamic_gears_merge_policy="product"))
    x = geared(torch.randn(2, 2), {0: list(range(1, 12)), 1: list(range(2, 13))})
    with pytest.raises(Exception) as e:
        compiled(x)
    err = graphgear.errors.graphgear_error(e.value)
    assert isinstance(err, GearError) and "121" in str(err) and "at most 100" in str(err)


@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead"])
@pytest.mark.parametrize("compile_sizes", [(), "all"])
def test_precompile_builds_every_gear_before_the_first_real_call(mode: str, compile_sizes) -> None:
    model = small_decoder().eval()
    ref = small_decoder().eval()
    ref.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=make_backend(mode, compile_sizes=compile_sizes))
    compiles = 3 if compile_sizes == "all" else 1  # per gear, or one shared by every gear
    tok = geared(torch.randint(0, 128, (2, 1)), {0: [1, 2, 4]})
    pos = torch.tensor([0])
    with torch.no_grad():
        out = graphgear.inference.precompile_gears(compiled, tok, pos)
        (g,) = graphgear.stats().graphs
        assert g.compiles == compiles  # at start-up
        if mode == "reduce-overhead":
            assert g.captures == 3  # and captured: warm-up and capture calls per gear
        assert_close(out, ref(tok, pos), reduction=512)
        for layer_c, layer_r in zip(model.layers, ref.layers):  # caches as after one real call
            assert_close(layer_c.attn.k_cache, layer_r.attn.k_cache, reduction=512)
        for b in (1, 4):
            t = geared(torch.randint(0, 128, (b, 1)), {0: [1, 2, 4]})
            assert_close(compiled(t, torch.tensor([1])), ref(t, torch.tensor([1])), reduction=512)
    g = graphgear.stats().graphs[0]
    assert g.compiles == compiles
    if mode == "reduce-overhead":
        assert g.captures == 3 and g.replays == 3  # the real call and the two after it


@pytest.mark.parametrize("mode", ["eager", "reduce-overhead"])
def test_padding_keeps_padded_mutated_input_in_place(mode: str) -> None:
    """An input written in place along a geared dim is padded into one buffer per gear
    (stable address: no capture per call) and the real rows are written back."""
    def f(x, state):
        state.add_(x)
        return state * 2

    compiled = torch.compile(f, backend=make_backend(mode, gear_padding=True))
    state, state_ref = torch.zeros(3, 4), torch.zeros(3, 4)
    for _ in range(4):
        x = torch.randn(3, 4)
        graphgear.set_dim_gears(x, {0: [2, 4]})
        graphgear.set_dim_gears(state, {0: [2, 4]})
        out = compiled(x, state)
        ref = f(x, state_ref)
        assert_close(out, ref, reduction=4)
        assert_close(state, state_ref, reduction=4)
    (g,) = graphgear.stats().graphs
    if mode == "reduce-overhead":
        assert g.captures == 1


class _SlotCache(torch.nn.Module):
    """A static cache of 8 slots, read and written as ``cache[:batch]`` (a serving
    engine's batch occupies the first slots)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.cache[: x.shape[0]]
        rows.add_(x)
        return rows * 2 + x


@pytest.mark.parametrize("mode", ["eager", "reduce-overhead", "max-autotune"])
def test_padding_puts_back_the_cache_rows_past_the_real_batch(mode: str) -> None:
    """A padded call writes its pad rows into ``cache[real:gear]``: those rows belong to
    no request of this call and a later, larger batch reads them. They were refused
    (``slice`` "from its end") or, in the docs' words, "not checked"; now they are saved
    and put back, so the cache equals eager's after every call, sizes arriving one call
    at a time."""
    model, ref = _SlotCache(), _SlotCache()
    compiled = torch.compile(model, backend=make_backend(mode, gear_padding=True))
    with torch.no_grad():
        for b in [4, 3, 5, 1, 8, 2, 7]:
            x = geared(torch.randn(b, 4), {0: [1, 2, 4, 8]})
            assert_close(compiled(x), ref(x), reduction=4)
            assert_close(model.cache, ref.cache, reduction=4)
    (g,) = graphgear.stats().graphs
    assert g.compiles <= 4


class _SlotCacheThenGather(_SlotCache):
    """Writes its slots, then gathers columns ``idx`` (out of range: raises after the write)."""

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        rows = self.cache[: x.shape[0]]
        rows.add_(x)
        return (rows * 2).index_select(1, idx)


def test_padding_puts_back_the_cache_rows_when_the_call_raises() -> None:
    """The saved rows go back even when the padded call fails after writing them: the
    cache then equals eager's after the same failure (real rows written, the rest not)."""
    model, ref = _SlotCacheThenGather(), _SlotCacheThenGather()
    compiled = torch.compile(model, backend=make_backend("eager", gear_padding=True))
    ok, bad = torch.tensor([1]), torch.tensor([9])
    with torch.no_grad():
        x = geared(torch.ones(4, 4), {0: [2, 4]})
        assert_close(compiled(x, ok), ref(x, ok))
        x = geared(torch.full((3, 4), 2.0), {0: [2, 4]})
        with pytest.raises((IndexError, RuntimeError)):
            ref(x, bad)
        with pytest.raises((IndexError, RuntimeError)):
            compiled(x, bad)
    assert torch.equal(model.cache, ref.cache), (model.cache, ref.cache)


def test_padding_reads_a_fixed_size_table_sliced_to_the_batch() -> None:
    """``table[:batch]`` read (not written): row-wise, accepted, and an output of size
    ``Min(8, batch)`` is sliced back."""
    table = torch.randn(8, 4)

    def f(x, t):
        return t[: x.shape[0]] + x, x + t[: x.shape[0]]

    compiled = torch.compile(f, backend=make_backend("eager", gear_padding=True))
    for b in (4, 3, 1, 6):
        x = geared(torch.randn(b, 4), {0: [2, 4, 8]})
        for got, want in zip(compiled(x, table), f(x, table)):
            assert got.shape == want.shape
            assert_close(got, want, reduction=4)


def test_padding_refuses_a_write_into_a_fixed_size_tensor_the_graph_made() -> None:
    """``buf[:batch] = x`` into a tensor the graph made, whose every row is read: the pad
    rows would land in real data. Refused, naming the node."""
    def f(x):
        buf = torch.ones(8, 4)
        buf[: x.shape[0]] = x
        return buf.sum(0)

    compiled = torch.compile(f, backend=make_backend("eager", gear_padding=True))
    x = geared(torch.randn(4, 4), {0: [2, 4, 8]})
    assert_close(compiled(x), f(x), reduction=8)
    with pytest.raises(GearError, match=r"slice_scatter .*a tensor of fixed size the graph made"):
        compiled(geared(torch.randn(3, 4), {0: [2, 4, 8]}))


@pytest.mark.parametrize("mode", ["eager", "reduce-overhead"])
def test_padding_a_decoder_with_a_slot_kv_cache_equals_eager(mode: str) -> None:
    """graphgear's embedded decoder writes its KV cache as ``k_cache[:bsz].index_copy_``:
    batches arriving one call at a time, without resetting the cache, give eager's logits
    and eager's cache (every slot, every position) after every call."""
    torch.manual_seed(0)
    model = small_decoder()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=make_backend(mode, gear_padding=True))
    with torch.no_grad():
        for pos, b in enumerate([8, 3, 5, 1, 6, 8, 2]):
            tok = geared(torch.randint(0, 128, (b, 1)), {0: [1, 2, 4, 8]})
            assert_close(compiled(tok, torch.tensor([pos])), ref(tok, torch.tensor([pos])), reduction=128)
            for mine, theirs in zip(model.layers, ref.layers):
                assert_close(mine.attn.k_cache, theirs.attn.k_cache, reduction=32)
                assert_close(mine.attn.v_cache, theirs.attn.v_cache, reduction=32)


_READ_ACROSS = {
    "flip": (lambda x: x.flip(0) * 2, "along a padded dim"),
    "softmax": (lambda x: x.softmax(0), "padded dim"),
    "sum": (lambda x: x.sum(0) + 1, "sum"),
    "contraction": (lambda x: x.t() @ x, "contracts over a padded dim"),
    "size-as-value": (lambda x: x * x.shape[0], "uses the padded size as a value"),
    "tensor-of-size": (lambda x: x + torch.tensor(x.shape[0]), "uses the padded size as a value"),
    "last-two": (lambda x: x[-2:].sum(), "from its end"),
    "last-row": (lambda x: x[-1] * 2, "indexes from the end of a padded dim"),
}


@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead"])
@pytest.mark.parametrize("case", sorted(_READ_ACROSS))
def test_padding_refuses_a_graph_whose_real_rows_read_the_padded_ones(mode: str, case: str) -> None:
    """Padding is exact only where real rows depend on real rows alone. A graph that
    reduces, reorders or contracts over the padded dim, counts from its end, or uses its
    size as a number gave silently wrong values at a padded size (a flip returned the
    pad's zeros, ``x * n`` the gear's n); now such a call raises GearError naming the
    node, before any work, and sizes that are gears still run."""
    fn, what = _READ_ACROSS[case]
    compiled = torch.compile(fn, backend=make_backend(mode, gear_padding=True))
    with torch.no_grad():
        x = geared(torch.randn(4, 4), {0: [2, 4, 8]})
        assert_close(compiled(x), fn(x), reduction=8)
        with pytest.raises(GearError) as e:
            compiled(geared(torch.randn(3, 4), {0: [2, 4, 8]}))
        msg = str(e.value)
        assert what in msg and "input 'x' dim 0 has size 3, padded to gear 4" in msg and "gear_padding" in msg
        x = geared(torch.randn(8, 4), {0: [2, 4, 8]})
        assert_close(compiled(x), fn(x), reduction=8)


@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead"])
def test_padding_returns_python_int_outputs_at_the_real_size(mode: str) -> None:
    """An int the graph returns from the padded size came back as the gear's (8, not 6)."""
    def fn(x):
        return torch.relu(x), x.shape[0] * 2

    compiled = torch.compile(fn, backend=make_backend(mode, gear_padding=True))
    for n in (4, 3, 3, 1):
        x = geared(torch.randn(n, 4), {0: [2, 4, 8]})
        out, size = compiled(x)
        assert size == 2 * n and out.shape == (n, 4)
        assert_close(out, torch.relu(x), reduction=1)


@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead"])
def test_padding_a_transposed_input(mode: str) -> None:
    """A transposed input was padded into a contiguous buffer: Inductor's code for the
    gear, compiled for the transposed strides, failed its stride assertion."""
    def fn(x):
        return x * 2 + 1

    compiled = torch.compile(fn, backend=make_backend(mode, gear_padding=True))
    for n in (4, 3, 3):
        x = torch.randn(5, n).t()
        graphgear.set_dim_gears(x, {0: [2, 4, 8]})
        assert_close(compiled(x), fn(x), reduction=1)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Attention written out over [batch, seq, dim], with or without a causal mask."""
    scores = q @ k.transpose(-1, -2) / 2.0
    if causal:
        n = q.shape[-2]
        pos = torch.arange(n)
        scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead"])
def test_padding_a_sequence_through_attention(mode: str) -> None:
    """Attention over a padded sequence is exact when a mask keeps real queries off the
    padded keys: a causal mask (written out, or ``is_causal`` in SDPA) runs padded and
    equals eager; the same attention unmasked is refused."""
    F = torch.nn.functional
    cases = {
        "causal": (lambda q, k, v: _attention(q, k, v, True), None),
        "sdpa-causal": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), None),
        "unmasked": (lambda q, k, v: _attention(q, k, v, False), "padded dim"),
        "sdpa-unmasked": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), "padded"),
    }
    for name, (fn, refused) in cases.items():
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=make_backend(mode, gear_padding=True))
        for n in (8, 5):
            q, k, v = (geared(torch.randn(2, n, 4), {1: [4, 8]}) for _ in range(3))
            if refused and n == 5:
                with pytest.raises(GearError, match=refused):
                    compiled(q, k, v)
                continue
            assert_close(compiled(q, k, v), fn(q, k, v), reduction=16, what=f"{name} at {n}")


# ------------------------------------------------------------ transformers Llama


def _llama_call(b: int, s: int, gears: dict[int, list[int]]) -> dict[str, torch.Tensor]:
    """Llama inputs as a server passes them: ids and position ids share the geared dims
    (without position ids, transformers compares the batch with 1 and dynamo guards on it)."""
    ids = geared(torch.randint(0, 128, (b, s)), gears)
    pos = geared(torch.arange(s).repeat(b, 1), gears)
    return {"input_ids": ids, "position_ids": pos, "use_cache": False}


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_hf_llama_batch_gears_with_padding(mode: str) -> None:
    model = hf_llama()
    compiled = torch.compile(model, backend=make_backend(mode, gear_padding=True), fullgraph=True)
    counters.clear()
    with torch.no_grad():
        for b in [1, 2, 3, 4, 1]:
            kw = _llama_call(b, 8, {0: [1, 2, 4]})
            assert_close(compiled(**kw).logits, model(**kw).logits, reduction=1024)
    assert counters["stats"]["unique_graphs"] == 1
    (g,) = graphgear.stats().graphs
    assert g.gears == [(1,), (2,), (4,)]


@pytest.mark.slow
@pytest.mark.parametrize("policy, sizes", [
    ("zip", [(1, 4), (2, 8), (4, 16)]),
    ("product", [(1, 4), (1, 16), (4, 8), (2, 4)]),
])
def test_hf_llama_batch_and_sequence_gears(policy: str, sizes) -> None:
    model = hf_llama()
    compiled = torch.compile(model, backend=make_backend("eager", dynamic_gears_merge_policy=policy),
                             fullgraph=True)
    counters.clear()
    with torch.no_grad():
        for b, s in sizes:
            kw = _llama_call(b, s, {0: [1, 2, 4], 1: [4, 8, 16]})
            assert_close(compiled(**kw).logits, model(**kw).logits, reduction=1024)
    assert counters["stats"]["unique_graphs"] == 1
    (g,) = graphgear.stats().graphs
    assert len(g.gears) == (3 if policy == "zip" else 9)


# ------------------------------------------------------------- tensor-subclass inputs


@pytest.mark.parametrize("mode", ["eager", "reduce-overhead"])
def test_gears_behind_a_tensor_subclass_input(mode: str) -> None:
    """AOTAutograd flattens a tensor-subclass input (a DTensor parameter under tensor
    parallelism; TwoTensor here) into its inner tensors in place, so the AOT graph has
    more inputs than dynamo's and a geared input behind the subclass is not where
    counting from the end puts it. The gears still reach it (and the error names it)."""
    from torch.testing._internal.two_tensor import TwoTensor

    def f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ w) + 1

    w = TwoTensor(torch.randn(16, 8), torch.randn(16, 8))
    compiled = torch.compile(f, backend=make_backend(mode), fullgraph=True)
    with torch.no_grad():
        for n in (2, 4, 2, 4):
            x = geared(torch.randn(n, 16), {0: [2, 4]})
            got, want = compiled(w, x), f(w, x)
            assert isinstance(got, TwoTensor)
            assert_close([got.a, got.b], [want.a, want.b], reduction=16)
        with pytest.raises(GearError) as e:
            compiled(w, torch.randn(3, 16))
    assert "size 3 at dim 0" in str(e.value) and "input 'x'" in str(e.value), str(e.value)
    (g,) = graphgear.stats().graphs
    assert g.gears == [(2,), (4,)], g
    assert "x" in g.inputs and "w.a" in g.inputs and "w.b" in g.inputs, g.inputs

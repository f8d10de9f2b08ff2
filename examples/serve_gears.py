"""Serving a decoder with gears: every graph built at start-up, none while serving.

    python examples/serve_gears.py [--threads 1]

A small decoder (random weights) takes its KV cache as an argument: each batch of
sequences brings a cache of its own, a key and a value tensor per layer, each
``[batch, heads, max_seq, head_dim]``, which every step writes in place at the step's
position. ``graphgear.inference.serve``
compiles it for serving (reduce-overhead, frozen weights, the serving guard filter). The
batch dim of the tokens and of the cache gets the gears 1, 2, 4 and 8, and with
``inference_config.gear_padding`` a batch between gears runs at the next gear up: the
tokens and the cache are zero-padded, the logits sliced back and the real rows of the
cache written back. ``graphgear.inference.precompile_gears`` builds (compiles and
captures) all four gears with one call at start-up.

Then batches of 3, 1, 5, 8, 2, 6, 4 and 7 sequences arrive, one batch at a time, as plain
tensors; each decodes a few greedy steps from position 0, next to an eager copy of the
model fed the same tokens and a cache of its own. Asserted: every step's logits and the
whole KV cache equal eager's (to fp32 rounding: the served products sum in another
order), and ``graphgear.stats()`` shows no compile and no capture after start-up, only
replays.
"""

from __future__ import annotations

import argparse
import copy
import math

from graphgear.cache.store import use_private_inductor_cache

use_private_inductor_cache()  # Inductor's on-disk cache in a folder private to this user

import torch  # noqa: E402
from torch import nn  # noqa: E402

import graphgear  # noqa: E402

GEARS = [1, 2, 4, 8]
BATCHES = [3, 1, 5, 8, 2, 6, 4, 7]
STEPS = 4  # greedy decode steps per batch
VOCAB, HIDDEN, LAYERS, HEADS, MAX_SEQ = 256, 64, 2, 4, 16
TOL = dict(rtol=1e-4, atol=1e-4)


class Layer(nn.Module):
    """Pre-norm attention over the cache, then a GELU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.out = nn.Linear(HIDDEN, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        # [batch, heads, seq, head_dim]. Batch 1 shares the graph of the other gears only
        # where torch's own code does not ask whether the batch is 1: one fused qkv product
        # split by a permute makes the matmul's reshape ask (is this view possible?), and
        # so does a write into a view of an input (a slice of one stacked cache); either
        # would compile a second graph for batch 1 after start-up.
        q, k, v = (proj(h).view(b, s, HEADS, HIDDEN // HEADS).transpose(1, 2) for proj in (self.q, self.k, self.v))
        k_cache.index_copy_(2, positions, k)
        v_cache.index_copy_(2, positions, v)
        scores = q @ k_cache.transpose(2, 3) / math.sqrt(HIDDEN // HEADS) + mask
        att = (scores.softmax(-1) @ v_cache).transpose(1, 2).reshape(b, s, HIDDEN)
        x = x + self.out(att)
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class Decoder(nn.Module):
    """``forward(tokens [batch, seq], positions [seq], cache) -> logits [batch, seq, vocab]``;
    ``cache`` (:func:`new_cache`: each layer's keys, then its values) is written in place
    at ``positions``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(MAX_SEQ, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB)
        causal = torch.full((MAX_SEQ, MAX_SEQ), float("-inf")).triu(1)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: list[torch.Tensor]) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(positions)
        mask = self.causal[positions]  # a query sees the positions up to its own
        for i, layer in enumerate(self.layers):
            x = layer(x, cache[2 * i], cache[2 * i + 1], positions, mask)
        return self.head(x)


def new_cache(batch: int) -> list[torch.Tensor]:
    return [torch.zeros(batch, HEADS, MAX_SEQ, HIDDEN // HEADS) for _ in range(2 * LAYERS)]


def clone(cache: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in cache]


def totals() -> dict[str, int]:
    graphs = graphgear.stats().graphs
    return {k: sum(getattr(g, k) for g in graphs) for k in ("compiles", "captures", "replays")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Decoder().eval()
    eager = copy.deepcopy(model)  # the same weights, run eagerly

    config = graphgear.CompilerConfig()
    config.mode = "reduce-overhead"
    config.inference_config.gear_padding = True
    served = graphgear.inference.serve(model, config)

    # start-up: one call builds every gear; the gears are set on this call's tensors only
    with torch.no_grad():
        tokens, cache = torch.randint(0, VOCAB, (max(GEARS), 1)), new_cache(max(GEARS))
        for t in [tokens, *cache]:
            graphgear.set_dim_gears(t, {0: GEARS})
        ref_cache = clone(cache)
        out = graphgear.inference.precompile_gears(served, tokens, torch.tensor([0]), cache)
        torch.testing.assert_close(out, eager(tokens, torch.tensor([0]), ref_cache), **TOL)
        torch.testing.assert_close(cache, ref_cache, **TOL)  # written once, as by one eager call
    start = totals()
    (graph,) = graphgear.stats().graphs
    assert graph.gears == [(g,) for g in GEARS], f"expected the gears {GEARS}\n{graphgear.stats()}"
    assert start["compiles"] == len(GEARS) and start["captures"] == len(GEARS), (
        f"precompile_gears should compile and capture every gear once\n{graphgear.stats()}")
    print(f"start-up: {start['compiles']} compiles, {start['captures']} captures (gears {GEARS})")
    print(graphgear.stats())

    worst = 0.0
    with torch.no_grad():
        for batch in BATCHES:
            tokens, cache, ref_cache = torch.randint(0, VOCAB, (batch, 1)), new_cache(batch), new_cache(batch)
            for pos in range(STEPS):
                positions = torch.tensor([pos])
                got, want = served(tokens, positions, cache), eager(tokens, positions, ref_cache)
                assert got.shape == want.shape == (batch, 1, VOCAB), f"batch {batch}: shape {tuple(got.shape)}"
                torch.testing.assert_close(got, want, **TOL, msg=lambda m, b=batch, s=pos: (
                    f"batch {b}, step {s}: logits differ from eager's\n{m}"))
                torch.testing.assert_close(cache, ref_cache, **TOL, msg=lambda m, b=batch, s=pos: (
                    f"batch {b}, step {s}: the KV cache differs from eager's\n{m}"))
                worst = max([worst, float((got - want).abs().max())]
                            + [float((c - r).abs().max()) for c, r in zip(cache, ref_cache)])
                tokens = want.argmax(-1)  # the same next tokens for both

        # a batch outside the gears is refused before any work; the model stays usable
        big = max(GEARS) + 1
        try:
            served(torch.zeros(big, 1, dtype=torch.long), torch.tensor([0]), new_cache(big))
        except Exception as e:  # noqa: BLE001 - checked below
            err = graphgear.errors.graphgear_error(e) or e
            assert isinstance(err, graphgear.GearError), f"batch {big}: expected a GearError, got {e!r}"
            print(f"batch {big}: {type(err).__name__}: {str(err).splitlines()[0]}")
        else:
            raise AssertionError(f"batch {big} is outside the gears {GEARS} and was not refused")

    end = totals()
    steps = len(BATCHES) * STEPS
    assert end["compiles"] == start["compiles"] and end["captures"] == start["captures"], (
        f"something compiled or captured while serving: {start} -> {end}\n{graphgear.stats()}")
    assert end["replays"] - start["replays"] == steps, (
        f"expected {steps} replays while serving, got {end['replays'] - start['replays']}")
    assert served.dynamo_calls == 1, (
        f"only the start-up call should have gone through dynamo, {served.dynamo_calls} did (a recompile?)")
    print(graphgear.stats())
    print(f"served {steps} decode steps at batches {BATCHES} (gears {GEARS}, padded between them): "
          f"logits and KV caches equal eager's (max abs diff {worst:.1e}); after start-up 0 compiles, "
          f"0 captures, {end['replays'] - start['replays']} replays; {served.direct_calls} of "
          f"{served.direct_calls + served.dynamo_calls} calls skipped dynamo's frame evaluation")
    print("ok")


if __name__ == "__main__":
    main()

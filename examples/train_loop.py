"""A training loop with graphgear: the model compiled, the optimizer eager, in both modes.

    python examples/train_loop.py [--steps 4] [--modes reduce-overhead,max-autotune]

A small classifier (embedding, two pre-norm residual MLP blocks, a linear head) is
compiled with ``torch.compile(model, backend=graphgear.get_backend(config))`` and trained
on one batch of random data (so the loss falls) with SGD with momentum, next to an eager
copy trained by its own optimizer on the same batch. AOTAutograd splits each step into a
forward and a backward graph; in ``reduce-overhead`` graphgear captures both (on the CPU:
its own CPU graph) and replays them every step, in ``max-autotune`` Inductor compiles
both. After every step the loss, every parameter's gradient and, after the optimizer
step, every parameter must equal eager's to fp32 rounding (asserted);
``graphgear.stats()`` is printed at the end.

Why not Adam here: its first step moves each weight by about ``lr * sign(grad)``, so a
gradient within rounding of zero (which the compiled backward sums in another order)
can move its weight by a whole ``lr`` one way or the other; the parameters would then
differ from eager's by far more than rounding while every gradient agrees.
"""

from __future__ import annotations

import argparse
import copy

from graphgear.cache.store import use_private_inductor_cache

use_private_inductor_cache()  # Inductor's on-disk cache in a folder private to this user

import torch  # noqa: E402
from torch import nn  # noqa: E402

import graphgear  # noqa: E402

VOCAB, HIDDEN, CLASSES, BATCH, SEQ = 64, 64, 10, 8, 12
TOL = dict(rtol=1e-4, atol=1e-5)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Classifier(nn.Module):
    """``forward(tokens [batch, seq]) -> logits [batch, classes]`` (mean over the sequence)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)).mean(1))


def train(mode: str, steps: int) -> None:
    graphgear.reset()
    torch.manual_seed(0)
    eager = Classifier()
    model = copy.deepcopy(eager)
    config = graphgear.CompilerConfig()
    config.mode = mode
    compiled = torch.compile(model, backend=graphgear.get_backend(compiler_config=config))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)  # one batch, learnt by heart
    labels = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(compiled(tokens), labels)
        ref_loss = nn.functional.cross_entropy(eager(tokens), labels)
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, **TOL,
                                   msg=lambda m, s=step: f"{mode}, step {s}: the loss differs from eager's\n{m}")
        for (name, p), ref in zip(model.named_parameters(), eager.parameters()):
            assert p.grad is not None, f"{mode}, step {step}: {name} got no gradient"
            torch.testing.assert_close(p.grad, ref.grad, **TOL, msg=lambda m, s=step, n=name: (
                f"{mode}, step {s}: the gradient of {n} differs from eager's\n{m}"))
        opt.step()
        ref_opt.step()
        for (name, p), ref in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p, ref, **TOL, msg=lambda m, s=step, n=name: (
                f"{mode}, step {s}: {n} after the optimizer step differs from eager's\n{m}"))
        losses.append(loss.item())
    graphs = graphgear.stats().graphs
    stages = sorted(g.stage for g in graphs)
    assert stages == ["backward", "forward"], f"{mode}: expected one forward and one backward graph\n{graphgear.stats()}"
    assert not any(g.fallbacks for g in graphs), f"{mode}: a graph fell back\n{graphgear.stats()}"
    if mode == "reduce-overhead":
        assert all(g.captures == 1 for g in graphs), f"expected one capture per graph\n{graphgear.stats()}"
    print(graphgear.stats())
    print(f"{mode}: {steps} SGD steps, losses {', '.join(f'{v:.4f}' for v in losses)}; loss, "
          f"{len(list(model.parameters()))} gradients and parameters equal eager's after every step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4, help="training steps per mode (default 4)")
    p.add_argument("--modes", default="reduce-overhead,max-autotune",
                   help="comma-separated modes (default reduce-overhead,max-autotune)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for mode in args.modes.split(","):
        assert mode in ("reduce-overhead", "max-autotune"), f"unknown mode {mode!r}"
        train(mode, args.steps)
    print("ok")


if __name__ == "__main__":
    main()

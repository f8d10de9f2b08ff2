"""Checks against eager PyTorch: outputs, every parameter's gradient, and in-place
mutations of inputs and buffers (KV caches)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch


def _flat(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if hasattr(x, "to_tuple"):  # transformers ModelOutput
        x = x.to_tuple()
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, list | tuple):
        return [t for item in x for t in _flat(item)]
    return []


def assert_close(actual: Any, expected: Any, atol: float = 1e-5, rtol: float = 1e-4, what: str = "output") -> None:
    a, e = _flat(actual), _flat(expected)
    assert len(a) == len(e), f"{what}: {len(a)} tensors, eager gave {len(e)}"
    for i, (x, y) in enumerate(zip(a, e)):
        assert x.shape == y.shape, f"{what}[{i}]: shape {tuple(x.shape)} != eager {tuple(y.shape)}"
        torch.testing.assert_close(x, y, atol=atol, rtol=rtol, msg=lambda m, i=i: f"{what}[{i}]: {m}")


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()} | {
        k: v.detach().clone() for k, v in model.named_buffers()
    }


def check_against_eager(
    model: torch.nn.Module,
    make_inputs: Callable[[], Sequence[Any]],
    compile_fn: Callable[[torch.nn.Module], Callable[..., Any]],
    *,
    train: bool = False,
    steps: int = 2,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    before_step: Callable[[torch.nn.Module], None] | None = None,
) -> Callable[..., Any]:
    """Run ``steps`` calls of a compiled copy and of the eager model on equal inputs;
    compare outputs, gradients (``train``) and every buffer after each step."""
    eager = model
    compiled_model = copy.deepcopy(model)
    compiled = compile_fn(compiled_model)
    loss_fn = loss_fn or (lambda out: sum(t.float().pow(2).mean() for t in _flat(out)))
    for step in range(steps):
        if before_step is not None:
            before_step(eager)
            before_step(compiled_model)
        inputs = make_inputs()
        inputs_c = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
        if train:
            out_e = eager(*inputs)
            out_c = compiled(*inputs_c)
            assert_close(out_c, out_e, atol, rtol, f"step {step} output")
            loss_fn(out_e).backward()
            loss_fn(out_c).backward()
            for (name, p_e), (_, p_c) in zip(eager.named_parameters(), compiled_model.named_parameters()):
                if p_e.grad is None:
                    assert p_c.grad is None, f"step {step}: grad of {name} exists only compiled"
                    continue
                assert p_c.grad is not None, f"step {step}: no gradient for {name}"
                torch.testing.assert_close(p_c.grad, p_e.grad, atol=atol * 10, rtol=rtol * 10,
                                           msg=lambda m, n=name, s=step: f"step {s} grad of {n}: {m}")
            eager.zero_grad(set_to_none=True)
            compiled_model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                out_e = eager(*inputs)
                out_c = compiled(*inputs_c)
            assert_close(out_c, out_e, atol, rtol, f"step {step} output")
        for x, y in zip(inputs_c, inputs):  # user inputs mutated in place
            if isinstance(x, torch.Tensor):
                torch.testing.assert_close(x, y, atol=atol, rtol=rtol)
        for (name, b_e), (_, b_c) in zip(eager.named_buffers(), compiled_model.named_buffers()):
            torch.testing.assert_close(b_c, b_e, atol=atol, rtol=rtol,
                                       msg=lambda m, n=name, s=step: f"step {s} buffer {n}: {m}")
    return compiled

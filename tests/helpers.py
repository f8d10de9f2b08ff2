"""Checks against eager PyTorch: outputs, every parameter's gradient, and in-place
mutations of inputs and buffers (KV caches)."""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

import graphgear


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


# ---- the tolerance policy: every tensor comparison in the tests goes through it ----
#
# Compiled code and eager PyTorch may add the same numbers in a different order (another
# thread count, a fused kernel, a reordered reduction). Each floating-point addition
# rounds by at most eps/2 of the running sum; with k terms summed in an arbitrary order
# the rounding errors behave like a random walk, so the typical difference between two
# orders grows as eps * sqrt(k) times the magnitude of the values summed. Per tensor:
#
#   atol = ATOL_FACTOR * eps(dtype) * sqrt(reduction) * max|expected|    (finite values)
#   rtol = RTOL_FACTOR * eps(dtype)
#
# where ``reduction`` is the number of terms summed into one element along the longest
# chain (the inner dim of a matmul, tokens x features for a weight gradient, times the
# layers for a whole model; an estimate is fine, sqrt makes it forgiving) and ``dtype``
# the precision the values were computed in (default: the expected tensor's). The
# factors leave an 8x margin over the worst differences seen between 1 and 2 threads,
# and keep atol far below a real error: with reduction up to 4096 atol is at most
# 1024 * eps * max|expected| (1.2e-4 of the largest value in float32), so a 1e-3 relative
# error on any element of the tensor's leading magnitude fails. Integer and bool tensors
# compare exactly; a tensor that should be all zeros must be exactly zero (pass
# ``scale=`` when the terms summed are large but the result cancels to ~0).
ATOL_FACTOR = 16.0
RTOL_FACTOR = 8.0


def tolerance(expected: torch.Tensor, *, reduction: int = 1, dtype: torch.dtype | None = None,
              scale: float | None = None) -> dict[str, float]:
    """``{"rtol": ..., "atol": ...}`` for comparing against ``expected`` (rule above)."""
    dtype = dtype or expected.dtype
    if not (dtype.is_floating_point or dtype.is_complex):
        return {"rtol": 0.0, "atol": 0.0}
    eps = torch.finfo(dtype).eps
    if scale is None:
        finite = expected.detach().abs()
        finite = finite[torch.isfinite(finite)]
        scale = float(finite.max()) if finite.numel() else 0.0
    k = max(int(reduction), 1)
    return {"rtol": RTOL_FACTOR * eps, "atol": ATOL_FACTOR * eps * math.sqrt(k) * scale}


def assert_close(actual: Any, expected: Any, *, reduction: int = 1, dtype: torch.dtype | None = None,
                 scale: float | None = None, what: str = "output") -> None:
    """Compare (nested) tensors with :func:`tolerance`: same count, shapes, dtypes, and
    values within the policy's rtol/atol per tensor."""
    a, e = _flat(actual), _flat(expected)
    assert len(a) == len(e), f"{what}: {len(a)} tensors, expected {len(e)}"
    for i, (x, y) in enumerate(zip(a, e)):
        name = what if len(e) == 1 and isinstance(expected, torch.Tensor) else f"{what}[{i}]"
        assert x.shape == y.shape, f"{name}: shape {tuple(x.shape)} != expected {tuple(y.shape)}"
        tol = tolerance(y, reduction=reduction, dtype=dtype, scale=scale)
        torch.testing.assert_close(
            x, y, **tol,
            msg=lambda m, n=name, t=tol: f"{n} (reduction={reduction}, rtol={t['rtol']:.3g}, "
                                         f"atol={t['atol']:.3g}): {m}")


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
    reduction: int = 256,
    grad_reduction: int | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    before_step: Callable[[torch.nn.Module], None] | None = None,
) -> Callable[..., Any]:
    """Run ``steps`` calls of a compiled copy and of the eager model on equal inputs;
    compare outputs, gradients (``train``) and every buffer after each step.

    ``reduction`` sizes the tolerance of outputs, mutated inputs and buffers (see
    :func:`tolerance`); gradients, which sum over the tokens and run the chain backwards,
    use ``grad_reduction`` (default ``100 * reduction``, 10x the tolerance)."""
    grad_reduction = grad_reduction if grad_reduction is not None else 100 * reduction
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
            assert_close(out_c, out_e, reduction=reduction, what=f"step {step} output")
            loss_fn(out_e).backward()
            loss_fn(out_c).backward()
            for (name, p_e), (_, p_c) in zip(eager.named_parameters(), compiled_model.named_parameters()):
                if p_e.grad is None:
                    assert p_c.grad is None, f"step {step}: grad of {name} exists only compiled"
                    continue
                assert p_c.grad is not None, f"step {step}: no gradient for {name}"
                assert_close(p_c.grad, p_e.grad, reduction=grad_reduction, what=f"step {step} grad of {name}")
            eager.zero_grad(set_to_none=True)
            compiled_model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                out_e = eager(*inputs)
                out_c = compiled(*inputs_c)
            assert_close(out_c, out_e, reduction=reduction, what=f"step {step} output")
        for x, y in zip(inputs_c, inputs):  # user inputs mutated in place
            if isinstance(x, torch.Tensor):
                assert_close(x, y, reduction=reduction, what=f"step {step} input")
        for (name, b_e), (_, b_c) in zip(eager.named_buffers(), compiled_model.named_buffers()):
            assert_close(b_c, b_e, reduction=reduction, what=f"step {step} buffer {name}")
    return compiled


def make_config(mode: str = "reduce-overhead", **opts: Any) -> graphgear.CompilerConfig:
    """A config in ``mode`` (``"eager"``: ``debug.run_eagerly``) with ``opts`` set by
    dotted path or unique leaf name (``warmup_iters=0``, ``gear_padding=True``)."""
    cfg = graphgear.CompilerConfig()
    if mode == "eager":
        cfg.debug.run_eagerly = True
    else:
        cfg.mode = mode
    graphgear.config.apply_options(cfg, opts)
    return cfg


def make_backend(mode: str = "reduce-overhead", **opts: Any) -> graphgear.backend.GraphgearBackend:
    """``graphgear.get_backend`` of :func:`make_config`."""
    return graphgear.get_backend(compiler_config=make_config(mode, **opts))


def last_record(stage: str = "inference") -> graphgear.stats.GraphRecord:
    """The last compiled graph of ``stage`` in ``graphgear.stats()``."""
    recs = [g for g in graphgear.stats().graphs if g.stage == stage]
    assert recs, f"no {stage} graph in {graphgear.stats()}"
    return recs[-1]


def unbuildable_kernel(monkeypatch: Any, caplog: Any, kernel: Callable[[], Any]) -> str:
    """Build one of graphgear's kernels (``kernel``: its cached ``kernel()``) as on a
    machine without a C++ compiler (the build raises): asserts it gives None and returns
    the warning logged."""
    import logging

    def no_compiler(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("g++: not found")

    monkeypatch.setattr(graphgear._torch.inductor, "inductor_load_cpp_kernel", no_compiler)
    with caplog.at_level(logging.WARNING, logger="graphgear.cpu.kernels"):
        assert kernel.__wrapped__() is None  # type: ignore[attr-defined]
    assert "could not be built (RuntimeError: g++: not found)" in caplog.text
    return str(caplog.text)


def ops_compiled(monkeypatch: Any, *targets: Any) -> list[tuple[int, ...]]:
    """Per static Inductor compile graphgear makes from now on: how many calls of each of
    ``targets`` (ops) the graph Inductor gets holds."""
    import graphgear.compilers.inductor as gi

    seen: list[tuple[int, ...]] = []
    real = gi.inductor_compile_fx_inner

    def spy(gm: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(tuple(len(gm.graph.find_nodes(op="call_function", target=t)) for t in targets))
        return real(gm, *args, **kwargs)

    monkeypatch.setattr(gi, "inductor_compile_fx_inner", spy)
    return seen


def each_thread_count(*counts: int) -> Any:
    """Iterate over ``counts`` with torch's intra-op thread count set to each in turn;
    the caller's count is restored after (also when the loop body raises)."""
    before = torch.get_num_threads()
    try:
        for n in counts:
            torch.set_num_threads(n)
            yield n
    finally:
        torch.set_num_threads(before)


def run_threads(worker: Callable[[int], Any], n: int, timeout: float = 600) -> None:
    """Run ``worker(0)`` .. ``worker(n - 1)`` in ``n`` threads at once and join them:
    fails if one hangs past ``timeout`` seconds, and re-raises the first exception a
    worker raised (the others are counted in the message)."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            worker(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise AssertionError(f"{len(errors)} of {n} threads failed; the first:") from errors[0]

"""Inference helpers, as in TorchAir's ``torchair.inference``: gears, precompilation,
and the serving option.

**Serving** (:func:`serve`, or :func:`serving_guard_filter` passed yourself): a served
model's step skips the guards that cannot change while it serves. dynamo checks, on
every call, guards on the model's modules (their attributes, the training flag, a
transformers config's fields through its ``__getattribute__``): on a small decoder that
is a third of the step (measured: 258 of ~700 µs of a Qwen2 hidden-256 step in the
profiler). With the filter dynamo drops every guard on ``nn.Module`` objects
(``torch.compiler.skip_guard_on_all_nn_modules_unsafe``) and every guard on a Python
global the traced code read (the library's functions, classes, enums and flags: about
half of what remains on a transformers model; tensor guards on globals stay), and keeps
the rest: the tensor guards (shapes, dtypes, strides, devices), torch's global state
(grad mode, autocast) and guards on the call's other Python state (a cache's
``is_initialized``, its length). Measured side by side (2026-12-01, transformers Qwen2
hidden 128, reduce-overhead with frozen parameters, batch 1, 1 thread): every guard 683
µs a step, modules dropped 568 µs, globals dropped too 516 µs. :func:`serve` also sets
``experimental_config.frozen_parameter``: parameters keep their address and value, so
the CPU graph packs the weights once (fast small-batch matmuls). It returns a
:class:`graphgear.served.ServedModel`, which runs the compiled code dynamo's guards accept
without dynamo's frame evaluation, and lets dynamo compile the (final) parameters into the
graph (see ``graphgear.served``).

Risks (why it is opt-in): after :func:`serve`, changing the model is not seen: a module
attribute or config field set later, ``model.train()``, a hook added, a parameter
replaced or updated in place other than by ``load_state_dict`` (the CPU graph computes
with the packed copy; weights loaded by ``load_state_dict`` make the next call compile
again), a global of the model's code rebound (a module-level flag of the library, a monkeypatched function). Serve a
model whose code, configuration and weights are final; compile it again (or call
``graphgear.reset()``) after changing any of them. Without module guards, dynamo can no
longer tell two instances of one model class apart: compiled code is shared per code
object, so :func:`serve` compiles with ``isolate_recompiles=True`` (its entries are its
own). Passing :func:`serving_guard_filter` yourself (transformers' ``CompileConfig``) is
safe for one served instance per model class and process.
"""

from __future__ import annotations

import inspect
import logging
import reprlib
from collections.abc import Callable
from typing import Any

import torch

from .backend import get_backend
from .cache.function import cache_compile
from .config import CompilerConfig
from .dispatch import precompile_gears
from .gears import set_dim_gears
from .served import ServedModel

log = logging.getLogger(__name__)

__all__ = ["ServedModel", "cache_compile", "precompile_gears", "serve", "serving_guard_filter", "set_dim_gears"]


def serving_guard_filter(guard_entries: list[Any]) -> list[bool]:
    """The guard filter of the serving option: drop every guard on an ``nn.Module`` and
    every guard on a Python global of the traced code except tensor guards; keep all
    others. Pass it as ``torch.compile(..., options={"guard_filter_fn":
    graphgear.inference.serving_guard_filter})``, for example in transformers'
    ``CompileConfig(options=...)``. See the module docstring for the risks."""
    no_modules = torch.compiler.skip_guard_on_all_nn_modules_unsafe(guard_entries)
    return [keep and (not e.is_global or e.guard_type == "TENSOR_MATCH")
            for e, keep in zip(guard_entries, no_modules)]


def serve(model: Callable[..., Any], config: CompilerConfig | None = None, *, direct: bool = True,
          **compile_kwargs: Any) -> ServedModel:
    """``torch.compile(model)`` with graphgear for serving: the config's mode (default
    ``reduce-overhead`` here), ``frozen_parameter`` on, and :func:`serving_guard_filter`.
    ``compile_kwargs`` go to ``torch.compile`` (``fullgraph``, ``dynamic``). The risks
    are in the module docstring.

    Returns a :class:`graphgear.served.ServedModel`: with ``direct`` (the default) a
    call whose compiled code dynamo's guards accept runs that code without dynamo's frame
    evaluation (the same guards, checked by dynamo's own guard managers; see
    ``graphgear.served``); ``direct=False`` sends every call through dynamo."""
    if not callable(model):
        raise TypeError(
            f"graphgear.inference.serve: model must be a callable (an nn.Module or a function), got "
            f"{type(model).__name__} {reprlib.repr(model)}. Pass the model itself: serve(model)."
        )
    if config is not None and not isinstance(config, CompilerConfig):
        raise TypeError(
            f"graphgear.inference.serve: config must be a graphgear.CompilerConfig or None, got "
            f"{type(config).__name__} {reprlib.repr(config)}. Build one first: "
            f"serve(model, graphgear.CompilerConfig.from_dict(d))."
        )
    if config is None:
        config = CompilerConfig()
        config.mode = "reduce-overhead"
    else:
        config = config.copy()
    config.experimental_config.frozen_parameter = True
    options = dict(compile_kwargs.pop("options", None) or {})
    options.setdefault("guard_filter_fn", serving_guard_filter)
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:  # torch >= 2.13
        compile_kwargs.setdefault("isolate_recompiles", True)
    else:
        log.warning("graphgear.inference.serve: this torch has no isolate_recompiles; serve one "
                    "instance per model class in a process (see graphgear.inference).")
    def compile_again(target: Any) -> Callable[..., Any]:
        # a backend of its own: new captures and frozen copies of the weights it now has
        return torch.compile(target, backend=get_backend(config), options=options, **compile_kwargs)

    return ServedModel(compile_again(model), model, direct=direct, frozen=True, compile_again=compile_again)

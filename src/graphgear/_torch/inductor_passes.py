"""Inductor's FX passes and pattern matcher (``torch._inductor.decomposition``,
``fx_passes``, ``pattern_matcher``, ``virtualized``): its decomposition table, its
random-op rewrite and no-op removal, the one-row product decomposition limit, the prim
that makes it store a value in a buffer (``torch._inductor.inductor_prims``), and the
pattern matcher graphgear registers its fusions with.

Checked on 2.13 (CPU build) and 2.14.1; Inductor's ``compile_fx`` uses each name (2.11 to
2.14). Every function imports ``torch._inductor`` lazily: it is heavy, and run_eagerly
never needs it. If they moved, graphgear's pattern fusions would not run, the static
graphs would lose their decompositions and graphs with dropout would not compile; each
wrapper has its note.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .fx import FakeTensorMode, detect_fake_mode

__all__ = [
    "inductor_decomp_table",
    "inductor_one_row_decompose_limit",
    "inductor_realize",
    "inductor_remove_noop_ops",
    "inductor_replace_random",
    "inductor_virtual_fake_mode",
    "pattern_matcher_pass",
    "register_pattern",
]


def inductor_decomp_table() -> dict[Any, Any]:
    """Inductor's decomposition table (it leaves out the entries that break attention
    gradients on the CPU); Inductor's own object, not a copy.

    ``torch._inductor.decomposition.select_decomp_table``: checked on 2.13; Inductor's
    ``compile_fx`` uses it (2.11 to 2.14). If it moved, max-autotune, the pattern tracer
    and the static graphs the CPU graph compiles would lose their decompositions."""
    from torch._decomp import core_aten_decompositions  # noqa: F401  (registers tables)
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_replace_random(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Inductor's random-op rewrite (``aten.rand``/``randn``/``bernoulli``/dropout to its
    own seeded ops), which its lowering requires and ``compile_fx`` runs among its joint
    graph passes before ``compile_fx_inner`` (that graphgear calls directly); returns the
    number of rewrites. Without it, a graph with dropout in training mode fails in
    Inductor's lowering ("should have been handled in replace_random.py").

    ``torch._inductor.fx_passes.replace_random.replace_random_passes``: checked on 2.13
    (2.11 to 2.14); a no-op under ``torch._inductor.config.fallback_random``. If it
    moved, such graphs fail to compile as before (max-autotune raises Inductor's error,
    a capture falls back to the uncompiled graph). Its rewrites trace replacements in
    Inductor's virtualized fake mode (``V.set_fake_mode``): the example inputs'."""
    from torch._inductor.fx_passes.replace_random import replace_random_passes
    from torch._inductor.virtualized import V

    if not any(n.op == "call_function" and n.target in _RANDOM_OPS() for n in gm.graph.nodes):
        return 0
    fake_mode = detect_fake_mode(list(example_inputs)) or FakeTensorMode(allow_non_fake_inputs=True)
    with V.set_fake_mode(fake_mode):
        count = int(replace_random_passes(gm) or 0)
    if count:
        gm.recompile()
    return count


@functools.cache
def _RANDOM_OPS() -> frozenset[Any]:  # noqa: N802 - a constant, built on first use
    """The ops ``replace_random``'s patterns match (2.13); dropout and ``bernoulli``
    reach Inductor decomposed into ``rand``."""
    aten = torch.ops.aten
    return frozenset({aten.rand.default, aten.rand.generator, aten.randn.default, aten.randn.generator,
                      aten.randint.low})


def inductor_one_row_decompose_limit() -> int:
    """The widest weight (either dimension) whose one-row product Inductor's
    ``decompose_mm_pass`` turns into a fused reduction on the CPU; a wider one stays an
    ATen product (MKL's ``sgemv``).

    ``torch._inductor.fx_passes.decompose_mem_bound_mm.cpu_max_other_dimension_decomposition``
    (2048 in 2.11 to 2.14; read once when that module is imported, so a later
    ``post_grad_fusion_options`` patch does not change it). Only a routing heuristic
    depends on it: if it moved, 2048 is assumed."""
    try:
        from torch._inductor.fx_passes import decompose_mem_bound_mm as d
    except ImportError:
        return 2048
    return int(getattr(d, "cpu_max_other_dimension_decomposition", 2048))


def inductor_realize(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself (a contiguous tensor), marked so Inductor stores it in a buffer rather
    than recomputing it inside each consumer's loop.

    Inductor inlines a pointwise value into every kernel that reads it; a reduction that
    reads it broadcast (a decode query against every key) recomputes it once per broadcast
    element, sines and cosines of a rotary embedding included. Inductor's
    ``prims.inductor_force_stride_order`` (what its own post-grad passes use to pin
    layouts) lowers to ``ExternKernel.require_stride_order``, which realizes the value; on
    an already contiguous tensor it computes nothing in eager mode.

    ``torch._inductor.inductor_prims.force_stride_order``: checked on 2.13 and 2.14.1 (an
    op ``torch.ops.prims.inductor_force_stride_order`` registered when
    ``torch._inductor.inductor_prims`` is imported; 2.11 has it too). If it went, the
    value is returned as is and Inductor may recompute it (slower, same values)."""
    try:
        from torch._inductor import inductor_prims
    except ImportError:  # pragma: no cover - torch without Inductor
        return t
    op = getattr(inductor_prims, "force_stride_order", None)
    if op is None:  # pragma: no cover - a torch that dropped the prim
        return t
    t = t.contiguous()
    return op(t, t.stride())


def inductor_remove_noop_ops(graph: torch.fx.Graph) -> None:
    """Inductor's post-grad removal of no-op views and copies, in place.

    ``torch._inductor.fx_passes.post_grad.remove_noop_ops``: checked on 2.13; Inductor's
    pattern matcher runs it on the graphs it traces in 2.13. If it moved, the joint-graph fusion patterns
    would stop matching graphs that carry such no-ops."""
    from torch._inductor.fx_passes.post_grad import remove_noop_ops

    remove_noop_ops(graph)


def inductor_virtual_fake_mode(fake_mode: Any) -> contextlib.AbstractContextManager[Any]:
    """Inductor's virtualized fake mode set to ``fake_mode`` (its pattern matcher traces
    replacements in it), a null context for None.

    ``torch._inductor.virtualized.V.set_fake_mode``: checked on 2.13; Inductor's
    ``compile_fx`` uses it (2.11 to 2.14). If it moved, replacement nodes would carry no
    fake values."""
    if fake_mode is None:
        return contextlib.nullcontext()
    from torch._inductor.virtualized import V

    return V.set_fake_mode(fake_mode)


def pattern_matcher_pass(name: str) -> Any:
    """A new Inductor ``PatternMatcherPass`` (``.apply(graph)`` returns the match count).

    ``torch._inductor.pattern_matcher.PatternMatcherPass(pass_name=)``: checked on 2.13;
    Inductor's own ``split_cat`` passes build theirs so in 2.13. If it changed, graphgear's
    pattern fusions (and users' ``register_replacement`` patterns) would not run."""
    from torch._inductor.pattern_matcher import PatternMatcherPass

    return PatternMatcherPass(pass_name=name)


def register_pattern(search_fn: Callable[..., Any], replace_fn: Callable[..., Any],
                     example_inputs: Sequence[Any], matcher: Any, *, training: bool,
                     get_decomp_fn: Callable[[], Any], **kwargs: Any) -> None:
    """Trace ``search_fn`` / ``replace_fn`` (forward and backward together when
    ``training``, with ``joint_fwd_bwd``, else the forward alone with ``fwd_only``) and
    add the pair to ``matcher``, skipping a duplicate. ``kwargs``: ``extra_check``,
    ``scalar_workaround``.

    ``torch._inductor.pattern_matcher.register_replacement``, ``fwd_only``,
    ``joint_fwd_bwd``: checked on 2.13; Inductor registers its own fusions with them
    (2.11 to 2.14). If they changed, as :func:`pattern_matcher_pass`; the caller skips a
    pattern that fails to trace."""
    from torch._inductor.pattern_matcher import fwd_only, joint_fwd_bwd, register_replacement

    register_replacement(
        search_fn,
        replace_fn,
        example_inputs,
        joint_fwd_bwd if training else fwd_only,
        matcher,
        get_decomp_fn=get_decomp_fn,
        skip_duplicates=True,
        **kwargs,
    )

"""FX tracing support: fake tensors and modes, the tracing context, torch's pytree, the
Python dispatcher, ``make_fx``'s private option, FX node internals, the
``backed_size_oblivious`` shape setting and Inductor's stable topological sort
(``torch._subclasses``, ``torch._guards``, ``torch.utils._pytree``, ``torch._dispatch``,
``torch.fx.experimental._config``, ``torch._inductor.pattern_matcher``).

Checked on 2.13 (CPU build) and 2.14.1; dynamo, AOTAutograd and Inductor use each name in
2.11 to 2.14. If they moved, graphgear could not re-trace graphs (gears, static graphs,
decompositions, pattern replacements), tell fake example inputs from real ones, or keep
a gear of size 1 on the dynamic graph; each re-export and wrapper has its note.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

# Re-exports. ``import torch`` already imports these modules (checked on 2.13), so
# importing them here costs nothing.
#
# torch._guards.TracingContext / tracing / detect_fake_mode: checked on 2.13; dynamo and
# AOTAutograd install the context with them (2.11 to 2.14). If they moved, graphgear would
# lose AOTAutograd's static-input indices, the tracing context its Inductor compiles need
# for the FX graph cache, and the fake mode of a graph.
from torch._guards import TracingContext, detect_fake_mode, tracing

# torch._subclasses.fake_tensor.FakeTensor / FakeTensorMode / unset_fake_temporarily:
# checked on 2.13; dynamo, AOTAutograd and Inductor all use them (2.11 to 2.14). If they
# moved, graphgear could not re-trace graphs (gears, static graphs, decompositions) or
# tell fake example inputs from real ones.
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

# torch.utils._pytree: checked on 2.13; torch's own tree utilities (used throughout
# dynamo/AOTAutograd, 2.11 to 2.14). If it moved, graphgear could not flatten a graph's
# outputs for Inductor or the arguments of an op it inlines. ``pytree.tree_flatten`` /
# ``tree_unflatten`` are all graphgear uses.
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

# torch.ops.higher_order.invoke_subgraph: checked on 2.13; the op
# torch.compiler.nested_compile_region puts in dynamo's graph, which AOTAutograd traces
# once per subgraph and Inductor compiles once (2.8 to 2.14). If it moved, graphgear's
# repeated regions (graphgear.regions) could not be outlined: every layer compiles.
INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph

__all__ = [
    "INVOKE_SUBGRAPH",
    "FakeTensor",
    "FakeTensorMode",
    "TracingContext",
    "detect_fake_mode",
    "enable_python_dispatcher",
    "fake_mode_of",
    "get_backed_size_oblivious",
    "make_fx_allowing_real_inputs",
    "node_erased",
    "pytree",
    "set_backed_size_oblivious",
    "stable_topological_sort",
    "tracing",
    "tracing_with",
    "unset_fake_temporarily",
]


def fake_mode_of(values: Any) -> Any:
    """The fake mode of the first fake tensor among ``values`` (or of the active tracing
    context), None when there is none.

    ``torch._guards.detect_fake_mode``: present in 2.11 to 2.14."""
    return detect_fake_mode(list(values))


def tracing_with(fake_mode: Any) -> contextlib.AbstractContextManager[Any]:
    """``torch._guards.tracing`` with a fresh ``TracingContext`` on ``fake_mode``, as
    dynamo gives a backend (checked on 2.13)."""
    return torch._guards.tracing(torch._guards.TracingContext(fake_mode))


def stable_topological_sort(graph: torch.fx.Graph) -> None:
    """Reorder ``graph`` so every node follows its inputs, keeping the order otherwise.

    ``torch._inductor.pattern_matcher.stable_topological_sort``: present in 2.11 to 2.14.
    Without it graphgear's pattern replacements could leave a node before an input."""
    from torch._inductor.pattern_matcher import stable_topological_sort as sort

    sort(graph)


def enable_python_dispatcher() -> contextlib.AbstractContextManager[Any]:
    """The Python dispatcher, on while tracing with ``make_fx`` over fake tensors with
    symbolic sizes (CompositeImplicit ops then decompose with SymInts, as AOTAutograd and
    Inductor's ``fwd_only`` trace them).

    ``torch._dispatch.python.enable_python_dispatcher``: checked on 2.13; AOTAutograd
    uses it (2.11 to 2.14). If it moved, graphgear's pre-grad fusions and decomposed
    attention replacements could not trace graphs with dynamic shapes."""
    from torch._dispatch.python import enable_python_dispatcher as enable

    return enable()


def make_fx_allowing_real_inputs(fn: Any, **kwargs: Any) -> Any:
    """``make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True, ...)``: trace with
    fake tensors made from real example inputs (checked on 2.13)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True, **kwargs)


def node_erased(node: torch.fx.Node) -> bool:
    """Whether ``node`` was removed from its graph (``fx.Node._erased``; checked on 2.13)."""
    return bool(node._erased)


def get_backed_size_oblivious() -> bool | None:
    """``torch.fx.experimental._config.backed_size_oblivious``, None where this torch has
    no such setting.

    Checked on 2.13; ``torch.fx.experimental.symbolic_shapes`` reads it in 2.13. If it went, a gear of
    size 1 would be 0/1-specialised by dynamo (a second graph) instead of sharing the
    dynamic one; graphgear then leaves the setting alone."""
    from torch.fx.experimental import _config

    return getattr(_config, "backed_size_oblivious", None)


def set_backed_size_oblivious(value: bool) -> None:
    """Set ``torch.fx.experimental._config.backed_size_oblivious`` (process-wide; see
    :func:`get_backed_size_oblivious`)."""
    from torch.fx.experimental import _config

    _config.backed_size_oblivious = value


def fake_values(gm: torch.fx.GraphModule, example_inputs: Any) -> None:
    """Set every node's ``meta["val"]`` by running ``gm`` on fake copies of
    ``example_inputs`` (in their fake mode, or a new one). The inputs' own mode comes
    first: ``detect_fake_mode`` prefers the active tracing context's, which is another
    one while torch loads a compiled function (a graph rebuilt from the compile cache)."""
    own = next((a.fake_mode for a in example_inputs if isinstance(a, FakeTensor)), None)
    mode = own or detect_fake_mode(example_inputs) or FakeTensorMode(allow_non_fake_inputs=True)
    prop = FakeTensorProp(gm, mode)
    if all(not isinstance(a, torch.Tensor) or isinstance(a, FakeTensor) for a in example_inputs):
        prop.propagate_dont_convert_inputs(*example_inputs)
    else:
        prop.propagate(*example_inputs)


def min_args(expr: Any) -> tuple[Any, ...] | None:
    """The arguments of ``expr`` when it is torch's symbolic ``Min`` (the size of ``t[:s]``
    on a dim of fixed size ``n`` is ``Min(n, s)``), else None.

    ``torch.utils._sympy.functions.Min`` (checked on 2.13): shape environments build
    their own ``Min``, not ``sympy.Min``. If it moved, gear padding would refuse a call
    that slices a fixed-size dim (a static KV cache) to the padded size, as it did before."""
    from torch.utils._sympy.functions import Min

    return tuple(expr.args) if isinstance(expr, Min) else None

"""AOTAutograd (``torch._functorch``): ``aot_module_simplified``, the descriptors that
say which input a placeholder holds, the joint-graph partitioners, the boxed calling
convention, the forward's returned outputs and a backward's tangents.

Checked on 2.13 (CPU build) and 2.14.1; dynamo's ``aot_autograd`` backend helper and
Inductor's ``compile_fx`` use the same names (2.11 to 2.14). If they moved, no graphgear
backend could compile, training graphs could not be split into forward and backward,
and gears and input names would be placed counting from the end; each wrapper has its
note.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from .fx import TracingContext

log = logging.getLogger(__name__)

__all__ = [
    "aot_forward_returns",
    "aot_input_source",
    "aot_module_simplified",
    "aot_partition_fn",
    "aot_tangents",
    "boxed_convention",
    "count_tangents",
    "is_boxed",
    "make_boxed_func",
]


def aot_module_simplified(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
    """``torch._functorch.aot_autograd.aot_module_simplified``, leaving out the keyword
    arguments this torch's version does not take (logged at debug level).

    Checked on 2.13; it is what ``torch._dynamo.backends.common.aot_autograd`` calls in
    2.13 (2.11 to 2.14). If it moved, no graphgear backend could compile.

    Like that helper, it counts the call in ``torch._dynamo.utils.counters["aot_autograd"]
    ["total"]`` (2.11 to 2.14): dynamo's DDP optimizer (``_dynamo/backends/distributed.py``)
    compiles each bucket's submodule with the backend under ``fakify_first_call``, where
    AOTAutograd's compiled function returns fake outputs on its first call, and it makes
    that first call itself only when the count moved. Without it the DDP optimizer skips
    that call and the user's first real step receives the fake tensors."""
    from torch._dynamo.utils import counters
    from torch._functorch.aot_autograd import aot_module_simplified as aot

    counters["aot_autograd"]["total"] += 1

    params = inspect.signature(aot).parameters
    dropped = [k for k in kwargs if k not in params]
    for k in dropped:
        log.debug("graphgear: this torch's aot_module_simplified has no %r; leaving it out", k)
        kwargs.pop(k)
    return aot(gm, example_inputs, **kwargs)


def aot_input_source(node: torch.fx.Node) -> tuple[int, tuple[str, ...]] | None:
    """Which input of the callable given to AOTAutograd an AOT graph's placeholder holds:
    ``(i, ())`` for input ``i`` itself, ``(i, ("_local_tensor",))`` for an inner tensor
    of input ``i`` when that input is a tensor subclass (a DTensor parameter) that
    AOTAutograd flattened (also a size or stride of one: ``("size", "0")``); None for what
    AOTAutograd added itself (parameters it lifted, effect tokens, RNG seeds, synthetic
    bases) or a placeholder with no descriptor.

    ``node.meta["desc"]`` with ``torch._functorch._aot_autograd.descriptors``'
    ``PlainAOTInput(idx)`` / ``SubclassGetAttrAOTInput(base, attr)`` /
    ``SubclassSizeAOTInput`` / ``SubclassStrideAOTInput``: checked on 2.13 (AOTAutograd's
    ``graph_capture`` sets it on every placeholder of the forward, inference and joint
    graphs; the partitioner keeps it). If it went (older or newer torch), this returns
    None and graphgear places gears and names counting from the end, which is right
    unless an input is a flattened subclass."""
    try:
        from torch._functorch._aot_autograd import descriptors as d
    except ImportError:
        return None
    desc = node.meta.get("desc")
    path: list[str] = []
    while True:
        if isinstance(desc, d.SubclassGetAttrAOTInput):
            path.append(desc.attr)
        elif isinstance(desc, d.SubclassSizeAOTInput):
            path += [str(desc.idx), "size"]
        elif isinstance(desc, d.SubclassStrideAOTInput):
            path += [str(desc.idx), "stride"]
        else:
            break
        desc = desc.base
    if isinstance(desc, d.PlainAOTInput):
        return desc.idx, tuple(reversed(path))
    return None


def aot_partition_fn(min_cut: bool) -> Callable[..., Any]:
    """AOTAutograd's joint-graph partitioner: ``min_cut_rematerialization_partition`` (as
    Inductor uses) or ``default_partition``.

    ``torch._functorch.partitioners``: checked on 2.13; dynamo's ``aot_autograd`` backend
    helper and Inductor's ``compile_fx`` use ``min_cut_rematerialization_partition`` in
    2.13 (2.11 to 2.14). If they moved, training graphs could not be split into
    forward and backward."""
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    return min_cut_rematerialization_partition if min_cut else default_partition


#: AOTAutograd's boxed calling protocol: a compiled callable whose ``_boxed_call`` is
#: True is called with one list of arguments (which it may clear), any other with
#: ``*args``. Checked on 2.13 (``_aot_autograd/runtime_wrappers.py`` reads it with
#: ``getattr(fn, "_boxed_call", False)``; 2.11 to 2.14 do the same). If it were renamed,
#: AOTAutograd would call graphgear's boxed graphs with ``*args`` and they would fail at
#: their first call, loudly.
_BOXED_ATTR = "_boxed_call"


_T = TypeVar("_T")


def boxed_convention(obj: _T) -> _T:
    """Declare ``obj`` (a function, or a class whose instances are called) boxed: it takes
    one list of arguments. Returns ``obj``, so it serves as a decorator."""
    setattr(obj, _BOXED_ATTR, True)
    return obj


def is_boxed(fn: Any) -> bool:
    """Whether ``fn`` follows the boxed convention (see :func:`boxed_convention`)."""
    return bool(getattr(fn, _BOXED_ATTR, False))


def make_boxed_func(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` taking one list of arguments (AOTAutograd's boxed calling convention).

    ``torch._functorch.aot_autograd.make_boxed_func``: checked on 2.13; AOTAutograd's own
    runtime wrappers use it in 2.13 (2.11 to 2.14). If it moved, graphgear could not
    hand an unboxed callable to AOTAutograd."""
    from torch._functorch.aot_autograd import make_boxed_func as boxed

    return boxed(fn)


def aot_forward_returns() -> int | None:
    """How many outputs of the training forward graph AOTAutograd is compiling now return
    to its caller (mutated inputs' new values, the user's outputs, RNG offsets); the
    ones after them are saved for the backward. None where no compile says.

    ``TracingContext.fw_metadata.num_forward`` (``ViewAndMutationMeta``): checked on 2.13
    (2.11 to 2.14). If it went, a padded training forward would slice its saved
    activations too, and its backward would refuse the call (sizes differ)."""
    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    n = getattr(meta, "num_forward", None)
    return n if isinstance(n, int) else None


def aot_tangents(gm: torch.fx.GraphModule) -> list[int]:
    """Indices of a backward graph's tangents (the gradients of the forward's outputs).

    AOTAutograd names them ``tangents_*``, the rule Inductor's ``count_tangents`` reads:
    checked on 2.13 (2.11 to 2.14)."""
    return [i for i, p in enumerate(gm.graph.find_nodes(op="placeholder")) if "tangents" in p.name]


def count_tangents(gm: torch.fx.GraphModule) -> int:
    """How many of a backward graph's inputs come before its tangents (the saved
    activations, which Inductor treats as static).

    ``torch._inductor.utils.count_tangents``: checked on 2.13; Inductor's backward
    compiler uses it (2.11 to 2.14). If it moved, max-autotune's backward compile would
    fail."""
    from torch._inductor.utils import count_tangents as count

    return count(gm)

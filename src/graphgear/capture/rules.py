"""What a device graph cannot hold, and where a graph runs.

:func:`find_uncapturable` lists every op of a graph that a device graph of a given
device cannot replay faithfully (``UNCAPTURABLE``: host reads, data-dependent shapes,
random numbers outside CUDA; data-dependent control flow; host side effects on a device;
CPU work inside a device graph); ``capture_config.fallback`` says what happens then.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..debug import op_key

log = logging.getLogger(__name__)

__all__ = ["COLLECTIVE_NAMESPACES", "UNCAPTURABLE", "find_collectives", "find_uncapturable", "graph_device",
           "node_uncapturable",
           "warn"]

#: ops a device graph cannot replay faithfully, with the reason (``stats()`` shows it)
UNCAPTURABLE = {
    "aten._local_scalar_dense": "reads a tensor value back to the host (.item())",
    "aten.nonzero": "output shape depends on the data",
    "aten.masked_select": "output shape depends on the data",
    "aten.unique": "output shape depends on the data",
    "aten._unique2": "output shape depends on the data",
    "aten.unique_consecutive": "output shape depends on the data",
    "aten.unique_dim": "output shape depends on the data",
    "aten.repeat_interleave": "output shape depends on the data",
    "aten.bernoulli": "random numbers: replay would repeat the captured draw",
    "aten.rand": "random numbers: replay would repeat the captured draw",
    "aten.randn": "random numbers: replay would repeat the captured draw",
    "aten.randint": "random numbers: replay would repeat the captured draw",
    "aten.rand_like": "random numbers: replay would repeat the captured draw",
    "aten.randn_like": "random numbers: replay would repeat the captured draw",
    "aten.native_dropout": "random numbers: replay would repeat the captured draw",
    "aten.normal": "random numbers: replay would repeat the captured draw",
    "aten.multinomial": "random numbers: replay would repeat the captured draw",
}


#: op namespaces of the collectives a graph holds: the functional collectives, and the
#: in-place c10d calls dynamo traces into them (``dist.all_reduce(t)``)
COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d"})


def find_collectives(gm: fx.GraphModule) -> list[str]:
    """The distinct collective ops of ``gm`` (sorted): a graph that holds one must run
    them exactly once per call on every rank, or the ranks fall out of step."""
    return sorted({op_key(n.target) for n in gm.graph.nodes
                   if n.op == "call_function" and getattr(n.target, "namespace", None) in COLLECTIVE_NAMESPACES})


def graph_device(example_inputs: Sequence[Any]) -> torch.device:
    """The device a graph runs on: its first non-CPU tensor input, else the CPU."""
    for a in example_inputs:
        if isinstance(a, torch.Tensor) and a.device.type not in ("cpu", "meta"):
            return a.device
    return torch.device("cpu")


_CONTROL_FLOW = {"cond", "while_loop", "higher_order.cond", "higher_order.while_loop"}
_EFFECTS = {"with_effects", "higher_order.with_effects"}


def find_uncapturable(gm: fx.GraphModule, device: torch.device) -> list[tuple[str, str]]:
    """``(op, reason)`` for every op of ``gm`` a ``device`` graph cannot hold."""
    found: list[tuple[str, str]] = []
    for n in gm.graph.nodes:
        reason = node_uncapturable(n, device)
        if reason is not None:
            found.append((op_key(n.target), reason))
    return found


def node_uncapturable(n: fx.Node, device: torch.device) -> str | None:
    """Why a ``device`` graph cannot hold node ``n``, or None where it can."""
    if n.op != "call_function":
        return None
    key = op_key(n.target)
    reason = UNCAPTURABLE.get(key)
    if reason is None and key in _CONTROL_FLOW:
        reason = "control flow that depends on the data: a graph replays one fixed path"
    if reason is None and key in _EFFECTS and device.type != "cpu":
        reason = (f"an op with a host side effect ({n.args[1] if len(n.args) > 1 else key}): "
                  f"a {device.type.upper()} graph replays only device work")
    if reason is not None:
        # CUDA graphs replay RNG safely: the generator's offset advances per replay.
        if device.type == "cuda" and reason.startswith("random numbers"):
            return None
        return reason
    val = n.meta.get("val")
    try:
        if val is not None and free_unbacked_symbols(val):
            if isinstance(val, torch.SymInt | torch.SymFloat | torch.SymBool):
                return "computes with a value read back to the host (.item())"
            return "output shape depends on the data"
    except Exception:
        pass
    if device.type != "cpu" and isinstance(val, torch.Tensor) and val.device.type == "cpu" \
            and val.numel() != 1:
        return f"runs on the CPU inside a {device.type.upper()} graph"
    return None


def warn(msg: str) -> None:
    warnings.warn(msg, UserWarning, stacklevel=3)
    log.warning(msg)

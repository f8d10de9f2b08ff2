"""What a capture engine runs: the compiled code of one static graph, made by the mode
compiler before the engine exists.

:class:`Executor` holds one code for every capture of the graph (every key, thread and
address). Where the code holds the static inputs' values (``frozen_parameter``: the
weights are constants of it), the compiler hands over an executor with
``holds_statics=True`` instead (``compilers.executors.FrozenExecutor``): it makes one code per
set of static inputs, and makes it again when their version counters show they were
written in place. The engine asks only :meth:`Executor.code` and, for such code,
:meth:`Executor.versions`; it never compiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._torch.storage import tensor_version

__all__ = ["Executor", "parameters_of"]


def parameters_of(statics: Sequence[Any]) -> tuple[Any, ...]:
    """The ``nn.Parameter``s among static inputs: what frozen code holds the values of
    (buffers and static-address state stay inputs, and may be written between calls)."""
    return tuple(t for t in statics if isinstance(t, torch.nn.Parameter))


class Executor:
    """One compiled code (what the device graph runs: ``DeviceKind.code``) shared by
    every capture of a static graph."""

    #: the code holds the values of the static inputs' parameters (one code per set)
    holds_statics = False

    def __init__(self, code: Any) -> None:
        self._code = code

    def code(self, args: Sequence[Any], statics: tuple[Any, ...] = ()) -> Any:
        """The code a capture on ``args`` (whose static inputs are ``statics``) runs."""
        return self._code

    def versions(self, params: Sequence[Any]) -> tuple[int, ...]:
        """The version counters of ``params`` (frozen code is stale when they moved)."""
        return tuple(map(tensor_version, params))

    def forget(self, statics: tuple[Any, ...]) -> None:
        """Drop the code made for ``statics`` (their parameters were written in place)."""

    def clear(self) -> None:
        """Drop every code made at run time (``graphgear.reset()``)."""

    @property
    def made(self) -> list[Any]:
        """The codes this executor holds now."""
        return [self._code]

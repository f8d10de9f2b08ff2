"""Gear padding at run time: a forward call between gears runs at the next gear up on
zero-padded inputs, its outputs sliced back (:class:`PaddedCall`); the backward of such
a forward pads its tangents and slices its gradients (:class:`PaddedBackward`). A call
that padding would make wrong is refused before any work (:mod:`.hazards`, and output
dims that are expressions of a padded size: :func:`.outputs.unsliceable_outputs`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from .._torch.aot import boxed_convention
from ..dispatch.facts import GraphFacts
from ..errors import GearError
from ..shapes import size_outputs, with_sizes
from .hazards import padding_checks
from .outputs import output_specs, slice_outputs, unsliceable_outputs

__all__ = ["PaddedBackward", "PaddedCall"]

#: the compiled boxed callable of one graph key (``KeyedGraph.get``)
GetKey = Callable[[tuple[int, ...]], Callable[..., Any]]

_TURN_OFF = "(config.inference_config.gear_padding = False)"


def _caller_specs(gm: fx.GraphModule, facts: GraphFacts) -> list[dict[int, int]]:
    """:func:`output_specs` of the outputs that go to the caller (the ones sliced)."""
    specs = output_specs(gm, facts.info)
    return specs if facts.caller_outputs is None else specs[: facts.caller_outputs]


class PaddedCall:
    """Runs a geared graph's call of key ``key`` at gear ``target`` (``get(target)``,
    the gear's compiled callable) on zero-padded inputs, slices every caller output dim
    of a grown symbol back, writes the real rows of mutated inputs back, and returns
    the graph's Python int outputs of its sizes at the real sizes. A training forward
    keeps the outputs saved for its backward at the gear's size. Rows of a graph input
    past the real size that the padded call writes (a static KV cache written as
    ``cache[:s]``: :class:`~graphgear.padding.hazards.RowWrite`) are saved before the
    call and put back after it, even when it raises."""

    def __init__(self, gm: fx.GraphModule, facts: GraphFacts, get: GetKey) -> None:
        assert facts.plan is not None
        self.facts = facts
        self.info = facts.info
        self.plan = facts.plan
        self.get = get
        self.specs = _caller_specs(gm, facts)
        n = len(self.specs)
        # output dims whose size is an expression of one (only the caller's are sliced)
        self.unsliceable = [u for u in unsliceable_outputs(gm, facts.info) if u.output < n]
        # nodes whose results padding changes: a padded call that grows one of their
        # symbols is refused
        self.hazards, self.row_writes = padding_checks(gm, facts.info.symbols, set(facts.plan.sym_gears))
        # outputs that are Python ints of the sizes: returned at the real sizes
        self.size_outputs = [(k, v) for k, v in size_outputs(gm) if k < n]
        # padded copies of inputs, one per (thread, argument, gear): a stable address, so
        # a captured graph that binds or mutates it in place is not captured again, and
        # concurrent callers never share one
        self._pad_buffers: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}

    def __call__(self, args: list[Any], key: tuple[int, ...], target: tuple[int, ...]) -> Any:
        info = self.info
        grow = {i: (key[i], target[i]) for i in range(len(key)) if key[i] != target[i]}
        self._check_sliceable(grow)
        self._check_hazards(grow)
        padded: list[int] = []
        strides = info.size_at(target)

        def pad(j: int, a: torch.Tensor, shape: list[int]) -> torch.Tensor:
            k = (threading.get_ident(), j, target)
            p = self._pad_buffers.get(k)
            if p is None or list(p.shape) != shape or p.dtype != a.dtype or p.device != a.device:
                # the gear's strides: its code was compiled for them (a transposed input
                # padded into a contiguous buffer fails Inductor's stride assertion)
                v = info.vals[j]
                p = torch.empty_strided(shape, [strides(x) for x in v.stride()], dtype=a.dtype,
                                        device=a.device).zero_()
                self._pad_buffers[k] = p
            else:
                p.zero_()
            p[tuple(slice(0, n) for n in a.shape)] = a
            padded.append(j)
            return p

        new_args = info.args_at(args, target, pad)
        saved = self._save_rows(args, grow)
        try:
            out = self.get(target)(list(new_args))  # a boxed callee may clear its list
            for j in padded:
                if j in self.facts.mutated:  # write the real rows back into the caller's tensor
                    args[j].copy_(new_args[j][tuple(slice(0, n) for n in args[j].shape)])
        finally:  # after the write-back: it copies whole padded inputs
            for region, rows in saved:
                region.copy_(rows)
        out = slice_outputs(out, self.specs, grow)
        return with_sizes(out, self.size_outputs, info.size_at(key)) if self.size_outputs else out

    def _save_rows(self, args: list[Any], grow: dict[int, tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(region, copy)`` for each input region past the real size that the padded call
        will write (``self.row_writes``); the caller copies each back after the call."""
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        for w in self.row_writes:
            if w.symbol not in grow:
                continue
            real, gear = grow[w.symbol]
            t = args[w.input]
            lo, hi = w.start + real, min(w.start + gear, t.shape[w.dim])
            if hi > lo:
                region = t.narrow(w.dim, lo, hi - lo)
                saved.append((region, region.clone()))
        return saved

    def _padded_inputs(self, hit: list[int], grow: dict[int, tuple[int, int]],
                       symbols: bool = False) -> tuple[str, str]:
        """For a refused padded call: which inputs grew (naming each dim's symbol with
        ``symbols``), and their gears."""
        where = self.plan.where
        padded = "; ".join(
            f"input {where[i][0]!r} dim {where[i][1]}"
            + (f" ({self.info.symbols[i]})" if symbols else "")
            + f" has size {grow[i][0]}, padded to gear {grow[i][1]}" for i in hit)
        gears = ", ".join(f"{where[i][0]!r} dim {where[i][1]}: {self.plan.sym_gears[i]}" for i in hit)
        return padded, gears

    def _check_hazards(self, grow: dict[int, tuple[int, int]]) -> None:
        """Refuse, before any work, a padded call whose graph reads across the padded
        rows or uses the padded size as a value (``padding_hazards``)."""
        for h in self.hazards:
            hit = sorted(i for i in h.symbols if i in grow)
            if not hit:
                continue
            padded, gears = self._padded_inputs(hit, grow)
            raise GearError(
                f"graphgear: gear padding cannot run this call of {self.facts.record.name}: {padded}, but "
                f"node {h.node} ({h.target}) {h.reason}, so the padded rows would change the "
                f"real results. Pass sizes that are gears ({gears}), or turn padding off {_TURN_OFF}.")

    def _check_sliceable(self, grow: dict[int, tuple[int, int]]) -> None:
        """Refuse, before any work, to pad a size that an output carries in an expression
        (``2*s`` from ``cat([x, x])``, ``3*s`` from ``reshape(-1)``): the padded rows sit
        inside the result, not at its end, so no slice gives the real values."""
        for u in self.unsliceable:
            hit = sorted(i for i in u.symbols if i in grow)
            if not hit:
                continue
            padded, gears = self._padded_inputs(hit, grow, symbols=True)
            raise GearError(
                f"graphgear: gear padding cannot run this call: {padded}, but output "
                f"{u.output} ({u.node}) has size {u.expr} at dim {u.dim}, an expression of "
                "the padded size, so the real values cannot be sliced out of the padded "
                f"result. Pass sizes that are gears ({gears}), or turn padding off {_TURN_OFF}."
            )


@boxed_convention
class PaddedBackward:
    """The backward of a graph whose forward may have run padded: its saved activations
    (read first: they give the key) have the gear's sizes, its tangents (the gradients
    of the caller's sliced outputs) the real ones. Each such tangent is zero-padded to
    the gear's size (the padded rows' gradients are zero, so they add nothing), the
    key's callable (``get``) runs, and the gradients it returns are sliced back."""

    def __init__(self, gm: fx.GraphModule, facts: GraphFacts, get: GetKey, per_key: bool = True) -> None:
        self.facts = facts
        self.info = facts.info
        self.get = get
        self.per_key = per_key
        self.specs = _caller_specs(gm, facts)

    def __call__(self, args: list[Any]) -> Any:
        key = self.info.key(args)
        grow = self._pad_tangents(args, key)
        out = self.get(key)(args)
        return slice_outputs(out, self.specs, grow) if grow else out

    def _pad_tangents(self, args: list[Any], key: tuple[int, ...]) -> dict[int, tuple[int, int]]:
        """Pad each tangent in ``args`` to its size at ``key``; returns ``{symbol: (real,
        gear)}``, how to slice the gradients."""
        grow: dict[int, tuple[int, int]] = {}
        info = self.info
        for j in self.facts.tangents:
            a = args[j]
            want = info.shape_at(j, key)
            if not isinstance(a, torch.Tensor) or want is None or list(a.shape) == want:
                continue
            for d, (have, gear) in enumerate(zip(a.shape, want)):
                if have == gear:
                    continue
                sym = info.symbol_at(j, d)
                i = info.symbols.index(sym) if sym is not None else None
                if i is None or have > gear or grow.get(i, (have, gear)) != (have, gear):
                    raise GearError(
                        f"graphgear: the backward of {self.facts.record.name} got gradient input "
                        f"{info.placeholders[j].name} of size {tuple(a.shape)} where its forward "
                        f"ran at {tuple(want)}; a forward run with gear padding can be "
                        f"differentiated only through outputs whose padded dims are plain gear "
                        f"dims. Pass sizes that are gears, or turn padding off {_TURN_OFF}.")
                grow[i] = (have, gear)
            ev = info.size_at(key)
            v = info.vals[j]
            p = torch.empty_strided(want, [ev(s) for s in v.stride()], dtype=a.dtype, device=a.device).zero_()
            p[tuple(slice(0, n) for n in a.shape)] = a
            args[j] = p
        return grow

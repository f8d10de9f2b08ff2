"""Gears: a fixed set of sizes for a dynamic dim, one graph key (a capture) per gear.

This module holds what the user sets and what the backend checks: ``set_dim_gears``,
the validation of gears, and :class:`GearPlan` (the allowed graph keys of one graph
under the merge policy). Run-time dispatch by key and precompilation are in
:mod:`graphgear.dispatch`, gear padding in :mod:`graphgear.padding`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

from ._torch.dynamo import mark_dynamic
from ._torch.fx import FakeTensor, get_backed_size_oblivious, set_backed_size_oblivious
from .errors import GearError
from .shapes import ShapeInfo
from .stats import on_reset

log = logging.getLogger(__name__)

__all__ = ["GearPlan", "get_dim_gears", "guard_gears_shape", "keep_size_one_dynamic", "set_dim_gears"]

_ATTR = "_graphgear_dim_gears"
MAX_GEARS = 100


def get_dim_gears(t: Any) -> dict[int, list[int]]:
    """Gears recorded on ``t`` (empty when none)."""
    return dict(getattr(t, _ATTR, None) or {})


def set_dim_gears(t: torch.Tensor, dim_gears: dict[int, list[int] | tuple[int, ...]]) -> None:
    """Limit dims of ``t`` to a fixed set of sizes; call before the first compiled call.

    Marks each listed dim dynamic; every other dim of ``t`` stays static. The gears are
    recorded on the tensor, so they hold through every recompile.
    """
    if not isinstance(t, torch.Tensor):
        raise GearError(f"graphgear.set_dim_gears: expected a torch.Tensor, got {type(t).__name__}.")
    if not isinstance(dim_gears, dict) or not dim_gears:
        raise GearError(
            f"graphgear.set_dim_gears: dim_gears must be a non-empty dict {{dim: [sizes]}}, "
            f"got {dim_gears!r}."
        )
    clean: dict[int, list[int]] = {}
    for dim, gears in dim_gears.items():
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise GearError(f"graphgear.set_dim_gears: dim must be an int, got {dim!r}.")
        if not -t.dim() <= dim < t.dim():
            raise GearError(
                f"graphgear.set_dim_gears: dim {dim} is out of range for a tensor of "
                f"{t.dim()} dims (shape {tuple(t.shape)}); allowed: {-t.dim()}..{t.dim() - 1}."
            )
        dim = dim % t.dim()
        if not isinstance(gears, list | tuple) or not all(
            isinstance(g, int) and not isinstance(g, bool) and g > 0 for g in gears
        ):
            raise GearError(
                f"graphgear.set_dim_gears: gears of dim {dim} must be a list or tuple of "
                f"positive ints, got {gears!r}."
            )
        sizes = sorted(set(gears))
        if not 2 <= len(sizes) <= MAX_GEARS:
            raise GearError(
                f"graphgear.set_dim_gears: dim {dim} needs 2 to {MAX_GEARS} distinct sizes, "
                f"got {len(sizes)} ({sizes}). For one size, leave the dim static."
            )
        clean[dim] = sizes
    old = get_dim_gears(t)
    for dim, sizes in clean.items():
        if dim in old and old[dim] != sizes:
            raise GearError(
                f"graphgear.set_dim_gears: dim {dim} of this tensor already has gears "
                f"{old[dim]}; it cannot be given {sizes}. Gears are fixed once set: use a "
                f"new tensor for other gears."
            )
    old.update(clean)
    setattr(t, _ATTR, old)
    if not isinstance(t, FakeTensor):
        for dim, sizes in clean.items():
            keep_size_one_dynamic(sizes)
            mark_dynamic(t, dim)


def guard_gears_shape(example_inputs: Any, names: Sequence[str] = ()) -> None:
    """Check that every concrete size of a geared dim is one of its gears (a dim that
    dynamo specialised to one size)."""
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            continue
        for dim, gears in get_dim_gears(x).items():
            size = x.shape[dim]
            if is_concrete_int(size) and int(size) not in gears:
                name = repr(names[i]) if i < len(names) else str(i)
                raise GearError(
                    f"graphgear: input {name} has size {int(size)} at dim {dim}, which is not "
                    f"one of its gears {gears}; pass a size in the gears (dynamo specialised "
                    "this dim, so padding cannot apply)."
                )


# --------------------------------------------------------------------------- plan


def _restore_size_oblivious() -> None:
    """Undo what :func:`keep_size_one_dynamic` turned on (run by ``graphgear.reset()``)."""
    set_backed_size_oblivious(False)


def keep_size_one_dynamic(sizes: list[int]) -> None:
    """Size 1 must not be 0/1-specialised by dynamo, whether it is a gear or padded up
    to one (that would trace a second graph): turn on size-oblivious reasoning for
    backed sizes, process-wide, until ``graphgear.reset()`` turns it off again (only
    where graphgear turned it on)."""
    if sizes:
        current = get_backed_size_oblivious()  # None: this torch has no such setting
        if current is not None and not current:
            on_reset(_restore_size_oblivious)
            log.info(
                "graphgear: size 1 is a gear (or pads up to one); enabling "
                "torch.fx.experimental._config.backed_size_oblivious so size 1 shares the "
                "dynamic graph instead of being specialised"
            )
            set_backed_size_oblivious(True)


class GearPlan:
    """The allowed graph keys of one AOT graph, from its inputs' gears.

    ``geared`` lists, per symbol of the graph key, the gears of that symbol (``None``
    for a symbol without gears, e.g. under ``dynamic=True``). ``keys`` is the set of
    allowed combinations of the geared symbols after the merge policy.
    """

    def __init__(
        self,
        info: ShapeInfo,
        sym_gears: dict[int, list[int]],
        where: dict[int, tuple[str, int]],
        policy: str,
    ) -> None:
        self.info = info
        self.sym_gears = sym_gears  # symbol index -> gears
        self.where = where  # symbol index -> (input name, dim) for messages
        self.policy = policy
        self.order = sorted(sym_gears)
        lists = [sym_gears[i] for i in self.order]
        if policy == "zip":
            lengths = {len(g) for g in lists}
            if len(lengths) > 1:
                desc = ", ".join(
                    f"{self.where[i][0]} dim {self.where[i][1]}: {sym_gears[i]}" for i in self.order
                )
                raise GearError(
                    "graphgear: dynamic_gears_merge_policy='zip' needs gear lists of equal "
                    f"length, got {desc}. Give every geared dim the same number of sizes, or "
                    "set config.inference_config.dynamic_gears_merge_policy = 'product'."
                )
            combos = list(zip(*lists))
        else:
            combos = list(itertools.product(*lists))
        combos = list(dict.fromkeys(combos))
        if len(combos) > MAX_GEARS:
            raise GearError(
                f"graphgear: the gears combine into {len(combos)} graphs under "
                f"dynamic_gears_merge_policy={policy!r}; at most {MAX_GEARS} are allowed. "
                "Use fewer sizes per dim, or 'zip' instead of 'product'."
            )
        self.combos = combos
        self._allowed = set(combos)

    @classmethod
    def build(
        cls, info: ShapeInfo, example_inputs: Sequence[Any], names: Sequence[str], policy: str
    ) -> GearPlan | None:
        sym_gears: dict[int, list[int]] = {}
        where: dict[int, tuple[str, int]] = {}
        for i, x in enumerate(example_inputs):
            for dim, gears in get_dim_gears(x).items():
                sym = info.symbol_at(i, dim)
                if sym is None:
                    continue  # the dim was specialised: a static graph, the guard checks it
                j = info.symbols.index(sym)
                if j in sym_gears and sym_gears[j] != gears:
                    sym_gears[j] = sorted(set(sym_gears[j]) & set(gears))
                else:
                    sym_gears[j] = list(gears)
                where.setdefault(j, (names[i] if i < len(names) else f"input {i}", dim))
        if not sym_gears:
            return None
        return cls(info, sym_gears, where, policy)

    def project(self, key: Sequence[int]) -> tuple[int, ...]:
        return tuple(key[i] for i in self.order)

    def allowed(self, key: Sequence[int]) -> bool:
        return self.project(key) in self._allowed

    def all_keys(self, template: Sequence[int]) -> list[tuple[int, ...]]:
        """Every allowed full key; non-geared symbols keep their value in ``template``."""
        out = []
        for combo in self.combos:
            k = list(template)
            for i, v in zip(self.order, combo):
                k[i] = v
            out.append(tuple(k))
        return out

    def pad_target(self, key: Sequence[int]) -> tuple[int, ...] | None:
        """The smallest allowed key at or above ``key`` in every geared symbol."""
        want = self.project(key)
        best: tuple[int, ...] | None = None
        for combo in self.combos:
            if all(c >= w for c, w in zip(combo, want)) and (best is None or sum(combo) < sum(best)):
                best = combo
        if best is None:
            return None
        k = list(key)
        for i, v in zip(self.order, best):
            k[i] = v
        return tuple(k)

    def error(self, key: Sequence[int], padding: bool) -> GearError:
        bad = [i for i in self.order if key[i] not in self.sym_gears[i]] or self.order
        parts = []
        for i in bad:
            name, dim = self.where[i]
            parts.append(
                f"input {name!r} has size {key[i]} at dim {dim}, which is not one of its gears "
                f"{self.sym_gears[i]}"
            )
        hint = (
            "the size is above the largest gear, so padding cannot help"
            if padding
            else "pass a size in the gears, or set config.inference_config.gear_padding = True "
            "to pad up to the next gear"
        )
        if len(self.order) > 1 and all(key[i] in self.sym_gears[i] for i in self.order):
            combo = dict(zip([self.where[i] for i in self.order], self.project(key)))
            return GearError(
                f"graphgear: the sizes {combo} are each a gear, but not a combination allowed "
                f"by dynamic_gears_merge_policy={self.policy!r} ({self.combos}); {hint}."
            )
        return GearError("graphgear: " + "; ".join(parts) + f"; {hint}.")

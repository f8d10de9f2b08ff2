"""Gears: a fixed set of sizes for a dynamic dim, one specialised graph per gear."""

from __future__ import annotations

from typing import Any

import torch

from .errors import GearError

__all__ = ["get_dim_gears", "set_dim_gears"]

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
    if not isinstance(t, torch._subclasses.FakeTensor):
        for dim, sizes in clean.items():
            torch._dynamo.mark_dynamic(t, dim)


def guard_gears_shape(example_inputs: Any) -> None:
    """Check that every concrete size of a geared dim is one of its gears."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            continue
        for dim, gears in get_dim_gears(x).items():
            size = x.shape[dim]
            if is_concrete_int(size) and int(size) not in gears:
                raise GearError(
                    f"graphgear: input {i} has size {int(size)} at dim {dim}, which is not "
                    f"one of its gears {gears}."
                )

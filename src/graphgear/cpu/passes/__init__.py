"""The CPU passes of a static Inductor compile: each small-M matrix product goes to the
product that serves its rows best (``compilers.inductor.compile_static``; max-autotune's
inference graphs run :class:`RouteSmallLinear` alone).

With ``frozen_parameter`` (the weights are constants of the graph), in this order
(:func:`frozen_passes`):

* ``group_frozen_products`` (:mod:`.pack_frozen`): products of the same rows by
  different weights become one product over the weights concatenated;
* ``pack_frozen_small``: products of 2 to 16 rows go to graphgear's packed product
  (:mod:`graphgear.cpu.kernels.small_gemm_kernel`), unless the weights outgrow the
  last-level cache (:func:`.pack_frozen.small_products_stream`);
* ``pack_frozen_linears``: the small-M products left, to MKL's packed GEMM;
* ``small_linear`` (:mod:`.route_small_linear`): the products left of up to 16 rows
  (those of one row only where Inductor's one-row decomposition cannot take the
  weight), to graphgear's row-major product on the weight as it lies
  (:mod:`graphgear.cpu.kernels.small_linear_kernel`).

Without it (weights passed in) only ``small_linear`` runs (:func:`unfrozen_passes`).
Each is a :class:`~graphgear.passes.manager.GraphPass` that decides by static sizes; its
name is in :func:`graphgear.passes.pass_names` (:data:`graphgear.passes.CPU_PASS_NAMES`),
so ``experimental_config.disabled_passes`` turns it off.
"""

from __future__ import annotations

from torch import fx

from ...passes.manager import GraphPass
from ..frozen import FrozenCopies
from ..kernels import small_linear_kernel
from .pack_frozen import (
    MIN_ROWS,
    GroupFrozenProducts,
    PackFrozenLinears,
    PackFrozenSmall,
    small_products_stream,
)
from .route_small_linear import RouteSmallLinear

__all__ = ["GroupFrozenProducts", "PackFrozenLinears", "PackFrozenSmall", "RouteSmallLinear", "frozen_passes",
           "unfrozen_passes"]


def frozen_passes(gm: fx.GraphModule, copies: FrozenCopies | None) -> list[GraphPass]:
    """The passes of a frozen static graph ``gm`` (CPU fp32 weights as constants), in
    order; their copies of the weights are made in ``copies``.

    Weights past the cache are read from memory every step: then their small-M products
    stream them as they lie (graphgear's row-major product), with no packed or grouped
    copy: only products of more rows than that product takes are grouped and packed."""
    stream = small_linear_kernel.kernel() is not None and small_products_stream(gm)
    packed_from = small_linear_kernel.MAX_ROWS + 1 if stream else MIN_ROWS
    return [
        GroupFrozenProducts(min_rows=packed_from, copies=copies),
        PackFrozenSmall(copies=copies, stream=stream),
        PackFrozenLinears(min_rows=packed_from, copies=copies),
        RouteSmallLinear(),
    ]


def unfrozen_passes() -> list[GraphPass]:
    """The passes of a static inference graph whose weights are inputs (they may change:
    products read them as they lie)."""
    return [RouteSmallLinear()]

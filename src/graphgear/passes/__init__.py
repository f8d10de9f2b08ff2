"""FX passes and the pass manager.

``default_passes(config)`` builds the post-grad pipeline every mode runs, in order:
the user's pre pass, ``remove_noop_ops``, ``pattern_fusion`` (registered replacements),
``fold_repeat_kv`` (grouped-query attention without the repeated KV copy),
``decode_attention`` (one-query CPU attention as generated code, where Inductor compiles),
``reinplace_inputs`` (in-place recovery), ``remove_cat_ops`` and ``reinplace_intermediates``
(where the graph runs as it is: no Inductor), ``view_to_reshape``, the user's post pass.
The joint-graph fusion passes (``experimental_config.fx_passes``) run earlier, on the
inference graph, or on a training graph's forward before differentiation (the joint
graph where that cannot run): see :mod:`graphgear.passes.joint`.

The CPU passes of a static Inductor compile (:mod:`graphgear.cpu.passes`: small-M
products to graphgear's kernels and MKL's packed GEMM) run later, inside the compile
(``compilers.inductor``), by the same pass manager; they sit above this package (they
import the kernels and run on the decomposed graph), so their names are listed here
(:data:`CPU_PASS_NAMES`).

Every pass is switchable: its own option where it has one (``remove_noop_ops``,
``pattern_fusion_pass``, ``fx_passes``), and by name in
``experimental_config.disabled_passes`` (see :func:`pass_names`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from .decode_attention import DecodeAttention
from .joint import joint_pass_manager
from .manager import GraphPass, PassManager, UserPass
from .noop import RemoveNoopOps
from .patterns import PatternFusion, register_replacement
from .reinplace import ReinplaceInputs
from .reinplace_intermediates import ReinplaceIntermediates
from .remove_cat import RemoveCatOps
from .repeat_kv import FoldRepeatKV
from .view_to_reshape import ViewToReshape


def _source_hash() -> str:
    """A hash of every pass's source (this package's files) and of the CPU package
    (``graphgear/cpu``: the CPU passes of the static compile, and graphgear's kernels the
    passes put in graphs, their ops and lowerings), as vLLM's ``InductorPass.uuid()``
    does: a pass that changes what it does to a graph in a way the graph's text does not
    show (node metadata Inductor reads) changes it, with nobody to remember a bump."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    root = here.parent
    for f in sorted(here.glob("*.py")) + sorted((root / "cpu").rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


#: Tags Inductor's cache key (``compilers.inductor.cache_context``), so the on-disk
#: cache never serves code compiled after another version of the passes.
PASSES_VERSION = _source_hash()

#: The CPU passes of a static Inductor compile (:mod:`graphgear.cpu.passes`), in the order
#: they run: named here for ``disabled_passes`` (tests/test_cpu_passes.py checks that the
#: passes carry these names).
CPU_PASS_NAMES = ("group_frozen_products", "pack_frozen_small", "pack_frozen_linears", "small_linear")

__all__ = [
    "CPU_PASS_NAMES",
    "PASSES_VERSION",
    "GraphPass",
    "PassManager",
    "UserPass",
    "check_disabled_passes",
    "default_passes",
    "pass_names",
    "post_grad_pass_manager",
    "static_pass_manager",
    "register_replacement",
]


def default_passes(config: Any) -> list[GraphPass]:
    passes: list[GraphPass] = []
    pre = config.experimental_config.post_grad_custom_pre_pass
    if pre is not None:
        passes.append(UserPass("post_grad_custom_pre_pass", pre))
    passes += [RemoveNoopOps(), PatternFusion(), FoldRepeatKV(), DecodeAttention(), ReinplaceInputs(),
               RemoveCatOps(), ReinplaceIntermediates(), ViewToReshape()]
    post = config.experimental_config.post_grad_custom_post_pass
    if post is not None:
        passes.append(UserPass("post_grad_custom_post_pass", post))
    return passes


def pass_names() -> list[str]:
    """Names of every built-in pass, in the order they run (joint passes first, the CPU
    passes of the static compile last)."""
    return joint_pass_manager().names() + [
        RemoveNoopOps.name, PatternFusion.name, FoldRepeatKV.name, DecodeAttention.name, ReinplaceInputs.name,
        RemoveCatOps.name, ReinplaceIntermediates.name, ViewToReshape.name,
        "post_grad_custom_pre_pass", "post_grad_custom_post_pass",
        *CPU_PASS_NAMES,
    ]


def check_disabled_passes(config: Any) -> None:
    """Raise ValueError naming every unknown name in ``experimental_config.disabled_passes``
    (checked when a backend or compiler is built and when ``options=`` change it)."""
    disabled = set(config.experimental_config.disabled_passes or ())
    unknown = sorted(disabled - set(pass_names()))
    if unknown:
        raise ValueError(
            f"graphgear: experimental_config.disabled_passes names unknown passes {unknown}; "
            f"known passes: {pass_names()}. Remove them or use one of the known names."
        )


def post_grad_pass_manager(config: Any) -> PassManager:
    return PassManager(default_passes(config))


def static_pass_manager(config: Any) -> PassManager:
    """The passes that decide by static sizes (``GraphPass.static_sizes``), run again on
    each static graph a dynamic graph is specialised to: on the dynamic graph they
    cannot tell a small attention from a large one. A served model that has seen two
    batch sizes gets a dynamic graph from dynamo (automatic dynamic shapes)."""
    return PassManager([p for p in default_passes(config) if p.static_sizes])

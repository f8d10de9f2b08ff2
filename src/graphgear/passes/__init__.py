"""FX passes and the pass manager.

``default_passes(config)`` builds the post-grad pipeline every mode runs, in order:
the user's pre pass, ``remove_noop_ops``, ``pattern_fusion`` (registered replacements),
``reinplace_inputs`` (in-place recovery), ``view_to_reshape``, the user's post pass.
The joint-graph fusion passes (``experimental_config.fx_passes``) run earlier, on the
joint or inference graph: see :mod:`graphgear.passes.joint`.

Every pass is switchable: its own option where it has one (``remove_noop_ops``,
``pattern_fusion_pass``, ``fx_passes``), and by name in
``experimental_config.disabled_passes`` (see :func:`pass_names`).
"""

from __future__ import annotations

from typing import Any

from .manager import GraphPass, PassManager, UserPass
from .noop import RemoveNoopOps
from .patterns import PatternFusion, register_replacement
from .reinplace import ReinplaceInputs
from .view_to_reshape import ViewToReshape

# Bump when a pass changes what it does to a graph in a way the graph's text does not
# show (node metadata Inductor reads): max-autotune adds it to Inductor's cache key, so
# the on-disk cache never serves code compiled after an older pass pipeline.
PASSES_VERSION = 2

__all__ = [
    "PASSES_VERSION",
    "GraphPass",
    "PassManager",
    "UserPass",
    "default_passes",
    "pass_names",
    "post_grad_pass_manager",
    "register_replacement",
]


def default_passes(config: Any) -> list[GraphPass]:
    passes: list[GraphPass] = []
    pre = config.experimental_config.post_grad_custom_pre_pass
    if pre is not None:
        passes.append(UserPass("post_grad_custom_pre_pass", pre))
    passes += [RemoveNoopOps(), PatternFusion(), ReinplaceInputs(), ViewToReshape()]
    post = config.experimental_config.post_grad_custom_post_pass
    if post is not None:
        passes.append(UserPass("post_grad_custom_post_pass", post))
    return passes


def pass_names() -> list[str]:
    """Names of every built-in pass, in the order they run (joint passes first)."""
    from .joint import joint_pass_manager

    return joint_pass_manager().names() + [
        RemoveNoopOps.name, PatternFusion.name, ReinplaceInputs.name, ViewToReshape.name,
        "post_grad_custom_pre_pass", "post_grad_custom_post_pass",
    ]


def post_grad_pass_manager(config: Any) -> PassManager:
    return PassManager(default_passes(config))

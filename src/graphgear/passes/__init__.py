"""FX passes and the pass manager.

``default_passes(config)`` builds the post-grad pipeline every mode runs, in order:
the user's pre pass, built-in clean-up passes, the user's post pass.
"""

from __future__ import annotations

from typing import Any

from .manager import GraphPass, PassManager, UserPass
from .noop import RemoveNoopOps

__all__ = ["GraphPass", "PassManager", "UserPass", "default_passes", "post_grad_pass_manager"]


def default_passes(config: Any) -> list[GraphPass]:
    passes: list[GraphPass] = []
    pre = config.experimental_config.post_grad_custom_pre_pass
    if pre is not None:
        passes.append(UserPass("post_grad_custom_pre_pass", pre))
    passes.append(RemoveNoopOps())
    post = config.experimental_config.post_grad_custom_post_pass
    if post is not None:
        passes.append(UserPass("post_grad_custom_post_pass", post))
    return passes


def post_grad_pass_manager(config: Any) -> PassManager:
    return PassManager(default_passes(config))

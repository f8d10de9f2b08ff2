"""Options that do nothing in the chosen mode, and combinations that cannot work.

As TorchAir's ``_check_config_support``: :func:`check_combinations` raises
:class:`~graphgear.errors.ConfigError` naming both options of a combination no mode can
honour (checked when a backend is built and when ``options=`` change its config);
:func:`warn_idle_options` warns of each option set to a non-default value that has no
effect in the mode and on the device a graph compiles for, once per backend (the
``"graphgear"`` string backend builds a backend per graph: its warnings are once per
process).
"""

from __future__ import annotations

import logging
import threading
import warnings

from .config import CompilerConfig, mode_of
from .errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["check_combinations", "warn_idle_options"]

_DEFAULTS = {path: opt.default for path, opt in CompilerConfig.option_paths().items()}
#: the modes by the name a message gives them
_MODE_NAMES = {"eager": "eager (debug.run_eagerly, TorchAir's force_eager)", "max-autotune": "'max-autotune'",
               "reduce-overhead": "'reduce-overhead'"}


def _non_default(config: CompilerConfig, prefix: str) -> list[tuple[str, object]]:
    return [(p, v) for p, v in config if p.startswith(prefix) and v != _DEFAULTS[p]]


def check_combinations(config: CompilerConfig) -> None:
    """Raise :class:`ConfigError` naming both options of a combination that cannot work."""
    cc, dump = config.capture_config, config.debug.data_dump
    if cc.force_recapture and config.debug.run_eagerly:
        raise ConfigError(
            "graphgear: capture_config.force_recapture=True cannot work with debug.run_eagerly=True "
            "(TorchAir's force_eager): force_recapture captures every call, run_eagerly never "
            "captures. Set one of them to False."
        )
    if cc.force_recapture and dump.enabled:
        raise ConfigError(
            "graphgear: capture_config.force_recapture=True cannot work with debug.data_dump.enabled=True "
            "(TorchAir's dump_tensor_data): a data dump runs each graph op by op and captures "
            "nothing. Set one of them to False."
        )
    if cc.use_custom_pool is not None and not cc.reuse_pool_across_gears:
        raise ConfigError(
            "graphgear: capture_config.reuse_pool_across_gears=False (TorchAir's "
            "reuse_graph_pool_in_same_fx) cannot be honoured with capture_config.use_custom_pool "
            "set (TorchAir's use_graph_pool): every capture of every gear goes to the one custom "
            "pool. Leave reuse_pool_across_gears at True, or use_custom_pool at None."
        )


def warn_idle_options(config: CompilerConfig, device_type: str, *, runs_as_is: bool,
                      seen: set[str] | None = None) -> list[str]:
    """Warn of each option set to a non-default value that has no effect when ``config``'s
    mode compiles a graph for ``device_type``, unless ``seen`` holds the message already
    (it is added); returns the messages warned. ``runs_as_is``: the mode runs the FX graph
    itself (no Inductor: ``passes.remove_cat.runs_as_is``)."""
    seen = set() if seen is None else seen
    out: list[str] = []
    mode = mode_of(config)
    name = _MODE_NAMES[mode]
    dump = config.debug.data_dump
    if mode != "reduce-overhead":
        for p, v in _non_default(config, "capture_config."):
            _warn_once(seen, out, f"graphgear: option {p}={v!r} has no effect in mode {name}: nothing "
                                  f"is captured; set mode='reduce-overhead' to capture.")
    elif dump.enabled:
        for p, v in _non_default(config, "capture_config."):
            _warn_once(seen, out, f"graphgear: option {p}={v!r} has no effect while debug.data_dump is "
                                  f"enabled: a data dump runs each graph op by op, nothing is captured.")
    elif device_type not in ("cuda", "npu") and config.capture_config.capture_error_mode != "thread_local":
        _warn_once(seen, out, f"graphgear: option capture_config.capture_error_mode="
                              f"{config.capture_config.capture_error_mode!r} has no effect on device "
                              f"{device_type}: it applies to CUDA and NPU graph capture only.")
    ex = config.experimental_config
    if ex.remove_cat_ops and not runs_as_is:
        _warn_once(seen, out, f"graphgear: option experimental_config.remove_cat_ops=True has no effect in "
                              f"mode {name} on device {device_type}: Inductor compiles the graph and writes "
                              f"the inputs of a cat into one buffer itself.")
    if not ex.inplace_pass and not runs_as_is:
        _warn_once(seen, out, f"graphgear: option experimental_config.inplace_pass=False has no effect in "
                              f"mode {name} on device {device_type}: Inductor compiles the graph and "
                              f"re-inplaces it itself; graphgear leaves that on (torch's own switch for it is "
                              f"Inductor's config disabled_passes='REINPLACE_INPLACEABLE_OPS').")
    if ex.static_kernel_compile:
        where = "off the NPU" if device_type != "npu" else "in graphgear"
        _warn_once(seen, out, f"graphgear: option experimental_config.static_kernel_compile=True has no "
                              f"meaning {where} (device {device_type}): it is TorchAir's static-shape kernel "
                              f"build for Ascend NPUs, which graphgear does not do. It is accepted and ignored.")
    if not dump.enabled:
        for p, v in _non_default(config, "debug.data_dump."):
            _warn_once(seen, out, f"graphgear: option {p}={v!r} has no effect while "
                                  f"debug.data_dump.enabled is False (TorchAir's dump_tensor_data).")
    return out


_lock = threading.Lock()


def _warn_once(seen: set[str], out: list[str], msg: str) -> None:
    with _lock:
        if msg in seen:
            return
        seen.add(msg)
    out.append(msg)
    warnings.warn(msg, UserWarning, stacklevel=4)
    log.warning(msg)

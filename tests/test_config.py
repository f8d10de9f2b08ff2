"""CompilerConfig: validation on assignment, dict round trip, options, no shared state."""

from __future__ import annotations

import pytest

import graphgear
from graphgear.config import CompilerConfig, apply_options


def test_defaults_match_design() -> None:
    c = CompilerConfig()
    assert c.mode == "max-autotune"
    assert c.debug.graph_dump.type is None and c.debug.graph_dump.path == "."
    assert c.debug.fx_summary.type is None and c.debug.run_eagerly is False
    e = c.experimental_config
    assert (e.fx_passes, e.keep_inference_input_mutations, e.frozen_parameter) == (False, True, False)
    assert (e.remove_noop_ops, e.pattern_fusion_pass) == (True, True)
    assert e.post_grad_custom_pre_pass is None and e.post_grad_custom_post_pass is None
    assert c.inference_config.dynamic_gears_merge_policy == "zip"
    assert c.inference_config.gear_padding is False
    cc = c.capture_config
    assert (cc.capture_limit, cc.clone_input, cc.clone_output, cc.use_custom_pool) == (64, True, False, None)
    assert (cc.reuse_pool_across_gears, cc.warmup_iters, cc.fallback) == (True, 1, "eager")


@pytest.mark.parametrize(
    "section, option, value, allowed",
    [
        ("", "mode", "fast", "'max-autotune', 'reduce-overhead'"),
        ("debug.graph_dump", "type", "json", "None, 'txt', 'py'"),
        ("debug.fx_summary", "type", "txt", "None, 'csv'"),
        ("debug", "run_eagerly", 1, "True, False"),
        ("experimental_config", "fx_passes", "yes", "True, False"),
        ("inference_config", "dynamic_gears_merge_policy", "cartesian", "'zip', 'product'"),
        ("capture_config", "capture_limit", 0, "an int >= 1"),
        ("capture_config", "capture_limit", True, "an int >= 1"),
        ("capture_config", "warmup_iters", -1, "an int >= 0"),
        ("capture_config", "fallback", "skip", "'eager', 'raise'"),
        ("experimental_config", "post_grad_custom_pre_pass", 3, "None or a callable"),
    ],
)
def test_bad_value_names_option_and_allowed(section: str, option: str, value: object, allowed: str) -> None:
    c = CompilerConfig()
    target = c
    for part in filter(None, section.split(".")):
        target = getattr(target, part)
    before = getattr(target, option)
    with pytest.raises(ValueError) as e:
        setattr(target, option, value)
    msg = str(e.value)
    path = f"{section}.{option}" if section else option
    assert repr(path) in msg and allowed in msg and repr(value) in msg
    assert getattr(target, option) == before  # a refused value leaves the old one


def test_unknown_attribute_lists_known() -> None:
    c = CompilerConfig()
    with pytest.raises(ValueError, match="unknown option 'capture_config.capture_limt'.*capture_limit"):
        c.capture_config.capture_limt = 3
    with pytest.raises(ValueError, match="is a section"):
        c.debug = None


def test_alias_npu_fx_pass() -> None:
    c = CompilerConfig()
    c.experimental_config.npu_fx_pass = True
    assert c.experimental_config.fx_passes is True
    assert c.experimental_config.npu_fx_pass is True


def test_as_dict_round_trip_and_independence() -> None:
    a = CompilerConfig()
    a.mode = "reduce-overhead"
    a.capture_config.capture_limit = 7
    a.debug.graph_dump.type = "py"
    b = CompilerConfig.from_dict(a.as_dict())
    assert b == a and b is not a
    b.capture_config.capture_limit = 9
    assert a.capture_config.capture_limit == 7
    assert CompilerConfig().capture_config.capture_limit == 64  # no class-level state
    flat = CompilerConfig.from_dict({"capture_config.capture_limit": 5, "mode": "reduce-overhead"})
    assert flat.capture_config.capture_limit == 5 and flat.mode == "reduce-overhead"


def test_from_dict_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="unknown option"):
        CompilerConfig.from_dict({"capture_config": {"nope": 1}})


def test_options_dotted_and_leaf_keys() -> None:
    c = apply_options(CompilerConfig(), {
        "mode": "reduce-overhead", "capture_limit": 16, "clone_output": True,
        "debug.graph_dump.type": "txt", "npu_fx_pass": True,
    })
    assert c.mode == "reduce-overhead" and c.capture_config.capture_limit == 16
    assert c.capture_config.clone_output and c.debug.graph_dump.type == "txt"
    assert c.experimental_config.fx_passes


def test_options_unknown_and_ambiguous_keys() -> None:
    with pytest.raises(ValueError) as e:
        apply_options(CompilerConfig(), {"capture_limitt": 1})
    assert "capture_config.capture_limit" in str(e.value) and "Known options" in str(e.value)
    with pytest.raises(ValueError, match="ambiguous.*debug.fx_summary.type.*debug.graph_dump.type"):
        apply_options(CompilerConfig(), {"type": "txt"})


def test_backends_do_not_share_config() -> None:
    cfg = CompilerConfig()
    b1 = graphgear.get_backend(compiler_config=cfg)
    cfg.mode = "reduce-overhead"
    b2 = graphgear.get_backend(compiler_config=cfg)
    assert b1.config.mode == "max-autotune" and b2.config.mode == "reduce-overhead"
    b2.config.capture_config.capture_limit = 3
    assert b1.config.capture_config.capture_limit == 64


def test_get_backend_rejects_wrong_config_type() -> None:
    with pytest.raises(TypeError, match="graphgear.CompilerConfig"):
        graphgear.get_backend(compiler_config={"mode": "reduce-overhead"})


def test_a_list_given_to_disabled_passes_stays_the_callers() -> None:
    """The list assigned was stored as is: appending to it later changed the config, its
    copies and every backend made from it, past validation (found by a probe)."""
    names = ["fold_repeat_kv"]
    c = CompilerConfig()
    c.experimental_config.disabled_passes = names
    copied = c.copy()
    names.append("no such pass")
    assert c.experimental_config.disabled_passes == ("fold_repeat_kv",)
    assert copied.experimental_config.disabled_passes == ("fold_repeat_kv",)


# ---- issue 43: arguments of the wrong type, close matches with TorchAir's names ------------


def test_options_of_the_wrong_type_name_the_argument_and_the_fix() -> None:
    """``options=[...]`` ended in "'list' object has no attribute 'items'" (torch.compile
    with the "graphgear" string or a get_backend backend, apply_options, from_dict)."""
    import torch

    msg = r"options= must be a dict of option names to values, e\.g\. .*got list \['mode'\]\. Pass a dict"
    with pytest.raises(graphgear.ConfigError, match=msg):
        apply_options(CompilerConfig(), ["mode"])  # type: ignore[arg-type]
    for backend in ("graphgear", graphgear.get_backend()):
        torch._dynamo.reset()
        f = torch.compile(lambda x: x + 1, backend=backend, options=["mode"])  # type: ignore[arg-type]
        with pytest.raises(Exception) as e:
            f(torch.ones(2))
        cause = graphgear.errors.graphgear_error(e.value)
        assert isinstance(cause, graphgear.ConfigError) and "options= must be a dict" in str(cause), e.value
    torch._dynamo.reset()
    with pytest.raises(graphgear.ConfigError, match=r"from_dict\(data\) takes a dict .*got list \[\('mode'"):
        CompilerConfig.from_dict([("mode", "reduce-overhead")])  # type: ignore[arg-type]


def test_serve_refuses_a_dict_config_and_a_non_callable_model() -> None:
    """``serve(model, config=dict)`` ended in an AttributeError, ``serve(3)`` in torch's
    AssertionError."""
    import torch

    from graphgear.inference import serve

    with pytest.raises(TypeError, match=r"serve: config must be a graphgear\.CompilerConfig or None, got dict "
                                        r"\{'mode': 'reduce-overhead'\}\. Build one first: .*from_dict"):
        serve(torch.nn.Linear(2, 2), config={"mode": "reduce-overhead"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"serve: model must be a callable \(an nn\.Module or a function\), "
                                        r"got int 3\."):
        serve(3)  # type: ignore[arg-type]


def test_unknown_option_suggests_close_names_torchair_aliases_included() -> None:
    """A misspelt TorchAir name (``force_eagre``) is pointed at ``force_eager`` and what
    it names; the known names include TorchAir's."""
    with pytest.raises(graphgear.ConfigError) as e:
        apply_options(CompilerConfig(), {"force_eagre": True})
    text = str(e.value)
    assert "Did you mean 'force_eager' (TorchAir's name of debug.run_eagerly)?" in text, text
    assert "TorchAir's names: " in text and "use_graph_pool" in text, text
    with pytest.raises(graphgear.ConfigError, match=r"Did you mean 'npu_fx_pass' \(TorchAir's name of "
                                                    r"experimental_config\.fx_passes\) or 'fx_passes'"):
        apply_options(CompilerConfig(), {"npu_fx_passes": True})
    with pytest.raises(graphgear.ConfigError, match=r"Did you mean 'capture_limit' \(capture_config\.capture_limit\)"):
        apply_options(CompilerConfig(), {"capture_limt": 1})
    with pytest.raises(graphgear.ConfigError) as e:
        apply_options(CompilerConfig(), {"zzz": 1})
    assert "Did you mean" not in str(e.value)
    c = CompilerConfig()
    with pytest.raises(graphgear.ConfigError, match=r"known options here: .*Did you mean 'force_eager' "
                                                    r"\(TorchAir's name of debug\.run_eagerly\)\?"):
        c.debug.force_eagre = True

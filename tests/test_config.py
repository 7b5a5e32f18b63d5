"""flashwatch/config.py: WatchConfig defaults and validation."""

from __future__ import annotations

import dataclasses

import pytest

from flashwatch import WatchConfig


def test_defaults_are_valid_and_frozen():
    cfg = WatchConfig()
    assert cfg.mitigation == "advise" and cfg.every_n_steps == 10
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.window = 3


@pytest.mark.parametrize("field,value,exc", [
    ("every_n_steps", 0, ValueError), ("every_n_steps", 2.5, TypeError),
    ("rows_per_head", 0, ValueError), ("rows_per_head", "All", ValueError),
    ("rows_per_head", 64.0, TypeError), ("sketch_dim", True, TypeError),
    ("window", 1, ValueError), ("seed", -1, ValueError), ("eps", 0.0, ValueError),
    ("beta", 1.0, ValueError), ("beta", float("nan"), ValueError),
    ("mitigation", "on", ValueError), ("backend", "cuda", ValueError),
    ("tie_ratio_threshold", 1.5, ValueError), ("coherence_threshold", 0.0, ValueError),
    ("drift_z_threshold", "4", TypeError), ("patience", 0, ValueError),
    ("route_all", 1, TypeError), ("power_max_iters", 3, ValueError),
    ("power_max_iters", 0, ValueError),
    ("delta_share_threshold", 0.0, ValueError), ("delta_share_steps", 0, ValueError),
    ("delta_share_min_grad_layer", 1.5, ValueError),
    ("delta_share_min_grad_peak", -0.1, ValueError),
    ("beta_max_excess", -1.0, ValueError), ("growth_min_logit", float("inf"), ValueError),
    ("qk_clip_threshold", -5.0, ValueError), ("qk_clip_threshold", "100", TypeError),
    ("qk_clip_alpha", -0.1, ValueError), ("qk_clip_alpha", float("nan"), ValueError),
])
def test_invalid_values_name_the_field(field, value, exc):
    with pytest.raises(exc, match=field):
        WatchConfig(**{field: value})


def test_rows_per_head_all_is_valid():
    assert WatchConfig(rows_per_head="all").rows_per_head == "all"


def test_from_kwargs_names_unknown_options():
    with pytest.raises(TypeError, match="every_n_step'"):
        WatchConfig.from_kwargs(every_n_step=5)
    assert WatchConfig.from_kwargs(window=8).window == 8


def test_from_kwargs_over_a_base_config_and_the_closest_name():
    base = WatchConfig(window=8, mitigation="auto")
    assert WatchConfig.from_kwargs(base) is base
    assert WatchConfig.from_kwargs(base, seed=3) == WatchConfig(window=8, mitigation="auto",
                                                                seed=3)
    with pytest.raises(ValueError, match="window must be ≥ 2"):  # replaced values checked
        WatchConfig.from_kwargs(base, window=1)
    with pytest.raises(TypeError, match=r"\(did you mean 'every_n_steps'\?\)"):
        WatchConfig.from_kwargs(base, every_n_step=5)
    with pytest.raises(TypeError, match=r"config must be a flashwatch.WatchConfig, got "
                       r"\{'window': 8\}"):
        WatchConfig.from_kwargs({"window": 8})
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['zz'\]; valid"):  # no hint
        WatchConfig.from_kwargs(zz=1)


def test_collective_timeout_must_be_a_positive_number_of_seconds():
    assert WatchConfig(collective_timeout_s=30).collective_timeout_s == 30
    for bad in (0, -1.0, float("nan"), "60"):
        with pytest.raises((ValueError, TypeError), match="collective_timeout_s"):
            WatchConfig(collective_timeout_s=bad)

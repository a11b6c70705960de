"""The engine's option groups: flat keywords in, one group per concern, Literal choices."""

from __future__ import annotations

from dataclasses import fields

import pytest

from headspace import UserError
from headspace.engine.config import (
    GROUPS,
    BudgetConfig,
    EngineConfig,
    OffloadConfig,
    flat_fields,
)
from headspace.engine.config_fields import choices
from headspace.parallel.config import ENGINE_FIELDS, ParallelConfig


def test_flat_keywords_land_in_their_groups():
    config = EngineConfig.of(offload="hybrid", cpu_share=0.5, kv_pool=5, page_size=64,
                             max_batch=8, balance="greedy")  # fmt: skip
    assert config.offload == OffloadConfig(mode="hybrid", cpu_share=0.5)
    assert config.budgets.kv_pool == 5 and config.cache.page_size == 64
    assert config.runtime.max_batch == 8 and config.runtime.dtype == "float32"
    assert config.parallel == ParallelConfig(balance="greedy")
    assert config.on("cpu").runtime.max_batch == 8  # the same options elsewhere


def test_every_flat_name_is_one_field_and_none_is_a_parallel_one():
    names = [name for name in flat_fields()]
    counted = sum(len(fields(group)) for group in GROUPS.values())
    assert len(names) == counted  # no two groups share a name
    assert not set(names) & set(ENGINE_FIELDS)
    assert flat_fields()["offload"] == ("offload", "mode")


def test_literal_types_are_the_choices_and_refuse_others():
    assert choices(OffloadConfig) == {"mode": ("auto", "none", "layer", "head", "hybrid")}
    assert choices(BudgetConfig) == {"kv_policy": ("snapkv", "ada_snapkv", "headkv")}
    assert choices(ParallelConfig)["balance_phase"] == ("auto", "prefill", "decode")
    with pytest.raises(UserError, match="offload must be one of auto, none, layer, head, "
                                        "hybrid, got 'sideways'"):  # fmt: skip
        EngineConfig.of(offload="sideways")
    with pytest.raises(UserError, match="dtype must be one of float32, bfloat16, float16"):
        EngineConfig.of(dtype="int8")
    for name in ("offload", "weights", "attention_backend", "kv_policy"):  # never None
        with pytest.raises(UserError, match=f"{name} must be one of .*, got None"):
            EngineConfig.of(**{name: None})
    assert EngineConfig.of(dtype=None).runtime.dtype == "float32"  # None: by the device
    for slowdown in (0.5, float("nan")):
        with pytest.raises(UserError, match="prefill_slowdown must be at least 1"):
            EngineConfig.of(prefill_slowdown=slowdown)
    for share in (0.0, 1.5, float("nan")):
        with pytest.raises(UserError, match="prefill_sm_share must be in \\(0, 1\\]"):
            EngineConfig.of(prefill_sm_share=share)
    assert EngineConfig.of(prefill_sm_share=1.0).runtime.prefill_sm_share == 1.0


def test_unknown_options_and_checks_across_groups_are_refused():
    with pytest.raises(UserError, match="unknown engine option\\(s\\): colour, parallel"):
        EngineConfig.of(colour="blue", parallel=ParallelConfig())
    with pytest.raises(UserError, match="cpu_sparsity needs offload 'hybrid'"):
        EngineConfig.of(cpu_sparsity=0.5)
    with pytest.raises(UserError, match="budgets must be a BudgetConfig"):
        EngineConfig(budgets={"kv_budget": 0.5})
    with pytest.raises(UserError, match="offload"):  # per-head pages stream no whole layers
        EngineConfig.of(kv_budget=0.5, offload="layer")


def test_the_hybrid_tiers_defaults_are_the_engines():
    """The tiers' hybrid settings default as the engine's offload options do (the tiers
    cannot import the engine's config: a test keeps the two alike)."""
    from headspace.engine.config import OffloadConfig
    from headspace.tiers.base import HybridSettings

    engine, tiers = OffloadConfig(), HybridSettings()
    assert (tiers.threads, tiers.sparsity, tiers.maw_alpha, tiers.gpu_window,
            tiers.query_blocks) == (engine.cpu_threads, engine.cpu_sparsity, engine.maw_alpha,
                                    engine.gpu_window, engine.cpu_query_blocks)  # fmt: skip

"""The planner prices patterns and KV budgets: what entries hold after the prompt, the share
of causal attention their prefill computes, and the roofline that follows."""

from __future__ import annotations

import json
import random

import pytest
import torch

from headspace import UserError
from headspace.attention.patterns import estimate
from headspace.cli.main import main
from headspace.kv.spec import Pattern
from headspace.model.config import config_from_dict
from headspace.planner import PlanRequest, make_plan
from headspace.planner.context import predict
from headspace.planner.profile import Profile, with_patterns
from headspace.planner.sparsity import attention_share, held_tokens
from test_planner import LLAMA3_8B

GiB = 2**30


@pytest.mark.parametrize("pattern", ["streaming(4,20)", "streaming(0,7)", "streaming(16,300)"])
@pytest.mark.parametrize("context", [1, 30, 257])
def test_streaming_share_counts_the_pairs_its_mask_allows(pattern, context):
    q, k = torch.randn(1, context, 8), torch.randn(1, context, 8)
    allowed = estimate([Pattern.parse(pattern)], q, k).dense().sum().item()
    assert attention_share(pattern, context) == pytest.approx(
        allowed / (context * (context + 1) / 2)
    )


def test_shares_are_one_for_full_and_shrink_with_fewer_keys():
    assert attention_share("full", 10**6) == 1.0
    assert attention_share("block_sparse(64)", 4096) == 1.0  # 64 blocks cover the prompt
    shares = [attention_share(f"block_sparse({k})", 2**19) for k in (8, 64, 512)]
    assert shares == sorted(shares) and shares[0] < 0.01 < shares[-1] < 0.5
    # 8 + 1 key blocks and 48 + 2 block diagonals: 7552 keys of each query
    assert 0.11 < attention_share("vertical_slash(1000,6096)", 2**17) < 0.116


@pytest.mark.parametrize("context", [700, 1024, 1500])
def test_a_vertical_slash_share_bounds_the_pairs_its_mask_allows(context):
    """Its blocks may overlap (a kept key block on a kept diagonal), never exceed."""
    q, k = torch.randn(2, context, 8), torch.randn(2, context, 8)
    pattern = "vertical_slash(100,200)"
    allowed = estimate([Pattern.parse(pattern)] * 2, q, k).dense().sum().item() / 2
    share = attention_share(pattern, context)
    assert 0.5 * share < allowed / (context * (context + 1) / 2) <= share


def test_held_tokens_by_pattern_and_budget():
    assert held_tokens("streaming(4,1024)", None, 100) == 100
    assert held_tokens("streaming(4,1024)", 50, 10**5) == 1028  # a ring ignores the budget
    assert held_tokens("block_sparse(8)", None, 10**5) == 10**5  # a prefill pattern keeps all
    assert held_tokens("full", 2500, 10**5) == 2500


def _plan(context: int, budget_tokens: int | None = None):
    config = config_from_dict(LLAMA3_8B)
    request = PlanRequest(context, 139 * GiB, 400 * GiB, budget_tokens=budget_tokens)
    return config, request, make_plan(config, request)


def test_patterns_and_budgets_price_into_memory_and_roofline():
    config, request, full = _plan(2**19)
    assert full.memory["kv_held"] == full.memory["gpu_kv"] == 64 * GiB
    scores = [[random.Random(layer).random() for _ in range(8)] for layer in range(32)]
    _, _, streaming = _plan(2**19)
    streaming.head_map = with_patterns(streaming.head_map, scores, 0.5, "streaming(4,1024)")
    predict(streaming, config, request)
    assert streaming.memory["kv_held"] == 128 * 2**19 * 512 + 128 * 1028 * 512
    assert streaming.prefill_tok_s > 1.5 * full.prefill_tok_s
    assert streaming.decode_ms < full.decode_ms
    _, _, budget = _plan(2**19, budget_tokens=2**17)
    assert budget.memory["kv_held"] == 16 * GiB and budget.decode_ms < streaming.decode_ms
    assert budget.prefill_tok_s == full.prefill_tok_s  # the prompt is attended in full


def test_plan_cli_prints_what_is_held_after_the_prompt(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    Profile("random", 32, 8, [[0.5] * 8] * 32).save(tmp_path / "p.json")
    base = ["plan", "--model", str(tmp_path), "--context", "512K", "--gpu-memory", "139GiB"]
    assert main([*base, "--kv-budget", "0.25"]) == 0
    assert "held after the prompt                16.00" in capsys.readouterr().out
    assert main([*base, "--profile", str(tmp_path / "p.json"), "--retrieval-heads",
                 "0.5"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "held after the prompt                32.06" in out and "streaming(4,1024)=128" in out
    assert "budget all=128, 1028=128" in out  # streaming heads keep sink and window
    assert main([*base, "--profile", str(tmp_path / "p.json"), "--kv-budget", "0.25"]) == 0
    assert "budget 131072=256" in capsys.readouterr().out  # a profile alone: every head full
    assert main([*base, "--profile", str(tmp_path / "p.json"), "--kv-budget", "0.25",
                 "--retrieval-heads", "0.5"]) == 0  # fmt: skip
    assert "budget 131072=128, 1028=128" in capsys.readouterr().out
    assert main([*base, "--kv-budget", "0"]) == 2
    assert "--kv-budget" in capsys.readouterr().err


def test_a_budget_that_does_not_fit_plans_entries_in_host_pages_priced_by_what_they_keep():
    """As the engine lays out budgets: the fewest entries of their own pages go to host
    pages (never a streaming head's ring), and decode streams only their kept tokens."""
    from headspace.planner.memory import Hardware

    config, hw = config_from_dict(LLAMA3_8B), Hardware()
    full = make_plan(config, PlanRequest(2**17, 24 * GiB, 400 * GiB, offload="head"), hw)
    request = PlanRequest(2**17, 24 * GiB, 400 * GiB, budget_tokens=2**15, entry_bound=2**15)
    budget = make_plan(config, request, hw)
    assert budget.offload == "head" and budget.staging is None and budget.entry_staging > 0
    assert budget.memory["total_gpu"] <= 24 * GiB
    assert budget.memory["staging"] == 2 * budget.entry_staging * 128 * 512
    offloaded = budget.head_map.num_offloaded
    assert 0 < offloaded < 256 and offloaded >= full.head_map.num_offloaded  # prompts first
    floor_ms = 1000 * offloaded * 2**15 * 512 / hw.h2d_bytes  # kept tokens, K and V
    assert budget.decode_pcie_floor_ms == pytest.approx(floor_ms)
    assert budget.decode_ms < 0.4 * full.decode_ms
    scores = tuple(tuple(random.Random(layer).random() for _ in range(8)) for layer in range(32))
    rings = make_plan(config, PlanRequest(2**19, 48 * GiB, 400 * GiB, retrieval=scores), hw)
    tiers = {(e.tier, e.pattern) for e in rings.head_map.entries}
    assert ("stream", "full") in tiers and ("gpu", "streaming(4,1024)") in tiers
    assert ("stream", "streaming(4,1024)") not in tiers


def test_the_keys_a_patterned_prefill_gathers_come_out_of_the_kv_arena(tmp_path):
    from headspace.engine.config import EngineConfig
    from headspace.engine.memory import kv_arena_bytes
    from headspace.kv.spec import KVSpec
    from headspace.planner.memory import weight_bytes
    from headspace.planner.sparsity import gathered_bytes

    config = config_from_dict(LLAMA3_8B)
    spec, weights = KVSpec.of(config, 128, 2), weight_bytes(config, 2)
    exact = EngineConfig.of(gpu_memory="40GiB", dtype="bfloat16")
    patterned = EngineConfig.of(gpu_memory="40GiB", dtype="bfloat16", profile=str(tmp_path),
                             retrieval_heads=0.5, sparse_pattern="block_sparse(8)")  # fmt: skip
    gathered = gathered_bytes(8, 4, 128, 2, 2**19)
    assert gathered == 2 * (2 * 8 * 2**19 * 128 * 2) + (4 * 4 * 4 + 1) * 64 * 2**19  # 4 + 2.03 GiB
    arenas = [kv_arena_bytes(config, c, spec, weights, 8192, 2**19) for c in (exact, patterned)]
    assert arenas[0] - arenas[1] == gathered
    small = EngineConfig.of(gpu_memory="19GiB", dtype="bfloat16", kv_budget=0.25)
    with pytest.raises(UserError, match="gathers with patterns or KV budgets"):
        kv_arena_bytes(config, small, spec, weights, 8192, 2**19)
    with pytest.raises(UserError, match="gathers with patterns or KV budgets"):  # plan too
        make_plan(config, PlanRequest(2**19, 19 * GiB, 400 * GiB, budget_tokens=2**17))


def test_plan_refuses_what_the_engine_refuses_for_per_entry_pages(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    # the host budget named: the default (90% of what is available now) follows the machine
    base = ["plan", "--model", str(tmp_path), "--context", "128K", "--gpu-memory", "24GiB",
            "--host-memory", "64GiB"]  # fmt: skip
    assert main([*base, "--kv-budget", "0.25", "--offload", "hybrid"]) == 2
    assert "offload single kv heads" in capsys.readouterr().err
    assert main([*base, "--kv-budget", "0.25", "--kv-policy", "ada_snapkv"]) == 0
    out = capsys.readouterr().out  # a share policy may give one entry the whole prompt:
    assert "2 staging slots of 6144 entry pages" in out  # its slot sized for that


def test_the_cpu_arena_without_a_budget_stays_within_half_the_host_memory():
    """On the CPU the arena is host memory: four full 128K contexts of Llama-3-8B (64 GiB)
    would not fit beside the weights on most machines, so it takes at most half of what
    is available; a short context still gets four of its own."""
    from headspace.engine.config import EngineConfig
    from headspace.engine.memory import host_budget, kv_arena_bytes
    from headspace.kv.spec import KVSpec

    cpu = EngineConfig.of(dtype="float32")
    config = config_from_dict(LLAMA3_8B)
    spec = KVSpec.of(config, 128, 4)
    arena = kv_arena_bytes(config, cpu, spec, 0, 1024, 2**17)
    four = (4 * spec.pages_for(2**17) + 1) * spec.full_page_bytes
    assert arena == min(four, host_budget(None) // 2 // spec.full_page_bytes * spec.full_page_bytes)
    assert arena <= host_budget(None) // 2 and arena % spec.full_page_bytes == 0
    four_short = (4 * spec.pages_for(1024) + 1) * spec.full_page_bytes  # 33 pages: 1.03 GiB
    assert kv_arena_bytes(config, cpu, spec, 0, 1024, 1024) == four_short

"""The per-head cost model the solvers balance, the head map's ranks it fills, and
``headspace plan --gpus N`` (no process group: pure arithmetic)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from headspace.cli.main import main
from headspace.model.config import config_from_dict
from headspace.parallel.balance import balance_heads, balanced_phases
from headspace.parallel.config import ParallelConfig
from headspace.planner.head_cost import CostShape, head_costs, roofline_cost
from headspace.planner.head_map import HeadEntry, HeadMap
from headspace.planner.memory import Hardware
from headspace.planner.profile import Profile
from test_planner import LLAMA3_8B

HW = Hardware()
SHAPE = CostShape.of(config_from_dict(LLAMA3_8B))  # 4 query heads per kv head, 128 x 4096


def test_decode_cost_is_the_bytes_an_entry_holds_at_its_tiers_rate():
    full = roofline_cost(HeadEntry(0, 0), SHAPE, HW, phase="decode", context=2**17)
    assert full.split == pytest.approx(2**17 * 2 * 128 * 2 / HW.hbm_bytes)
    assert full.fixed == pytest.approx(10 * 128 * 4096 * 2 / HW.hbm_bytes  # q, o: 4 rows; k, v
                                       + HW.decode_row_seconds)  # the kernel's row  # fmt: skip
    assert full.copy == pytest.approx(HW.copy_seconds + HW.copy_row_seconds)
    quarter = roofline_cost(HeadEntry(0, 0, budget=2**15), SHAPE, HW, phase="decode",
                            context=2**17, batch=3)  # fmt: skip
    assert quarter.split == pytest.approx(3 * full.split / 4)
    # a copy repeats the rows of every sequence, and adds a merge and work per sequence
    assert quarter.fixed - full.fixed == pytest.approx(2 * HW.decode_row_seconds)
    assert quarter.copy - full.copy == pytest.approx(2 * HW.copy_row_seconds)
    ring = HeadEntry(0, 0, pattern="streaming(4,1020)")
    assert roofline_cost(ring, SHAPE, HW, phase="decode", context=2**17).split == pytest.approx(
        full.split / 128
    )
    streamed = roofline_cost(HeadEntry(0, 0, tier="stream"), SHAPE, HW, phase="decode",
                             context=2**17)  # fmt: skip
    assert streamed.split / full.split == pytest.approx(HW.hbm_bytes / HW.h2d_bytes)


def test_prefill_cost_is_the_keys_a_pattern_attends():
    context, chunk = 2**17, 8192
    full = roofline_cost(HeadEntry(0, 0), SHAPE, HW, phase="prefill", context=context,
                         chunk=chunk)  # fmt: skip
    assert full.split == pytest.approx(4 * 4 * 128 * chunk * context / HW.attention_flops)
    sparse = roofline_cost(HeadEntry(0, 0, pattern="block_sparse(64)"), SHAPE, HW,
                           phase="prefill", context=context, chunk=chunk)  # fmt: skip
    assert sparse.split == pytest.approx(full.split * 64 * 128 / context)
    with pytest.raises(ValueError, match="phase"):
        roofline_cost(HeadEntry(0, 0), SHAPE, HW, phase="train", context=8)


def test_a_profiles_measured_cost_is_scaled_by_the_roofline():
    profile = Profile("m", 1, 2, [[1.0, 0.0]], chunk=1024,
                      pattern_ms={"full": {"2048": 10.0}})  # fmt: skip
    head_map = HeadMap(1, 2, [HeadEntry(0, 0), HeadEntry(0, 1, pattern="streaming(4,60)")])
    costs = head_costs(head_map, SHAPE, HW, phase="prefill", context=4096, chunk=2048,
                       profile=profile)  # fmt: skip
    assert costs[0][0].split == pytest.approx(10e-3 * 2 * 2)  # twice the keys, twice the chunk
    unmeasured = roofline_cost(head_map.entry(0, 1), SHAPE, HW, phase="prefill", context=4096,
                               chunk=2048)  # fmt: skip
    assert costs[0][1] == unmeasured  # the profile did not measure streaming: the roofline


def _map(patterns: list[list[str]], budgets=None) -> HeadMap:
    entries = [HeadEntry(layer, head, pattern=p, budget=None if budgets is None else
                         budgets[layer][head]) for layer, row in enumerate(patterns)
               for head, p in enumerate(row)]  # fmt: skip
    return HeadMap(len(patterns), len(patterns[0]), entries)


def test_auto_balances_both_phases():
    assert balanced_phases("auto") == ("prefill", "decode")
    assert balanced_phases("prefill") == ("prefill",)
    # Ada-SnapKV's uneven heads cost alike at prefill: balancing decode alone leaves the
    # ranks uneven head counts (one holds a heavy head alone, another the light ones), so
    # prefill waits for the rank with the most heads; both at once keep two heads a rank
    budgets = [[60_000, 50_000, 2_000, 1_000, 1_000, 3_000, 2_000, 1_000] for _ in range(4)]
    head_map = _map([["full"] * 8] * 4, budgets)
    config = ParallelConfig(gpus=4, balance="greedy")
    both = balance_heads(head_map, SHAPE, config, context=2**17)
    decode = balance_heads(head_map, SHAPE, replace(config, balance_phase="decode"),
                           context=2**17)  # fmt: skip
    uniform = balance_heads(head_map, SHAPE, replace(config, balance="uniform"), context=2**17)
    assert both.phase == "prefill+decode" and decode.phase == "decode"
    step = {
        name: {p: b.loads[p]["step_seconds"] for p in ("prefill", "decode")}
        for name, b in (("both", both), ("decode", decode), ("uniform", uniform))
    }
    assert step["decode"]["prefill"] > 1.4 * step["uniform"]["prefill"]
    assert step["both"]["prefill"] == pytest.approx(step["uniform"]["prefill"])
    assert step["both"]["decode"] < step["uniform"]["decode"] / 1.4


def test_balancing_fills_every_entrys_ranks_and_beats_uniform():
    # per-head budgets as Ada-SnapKV leaves them: two heavy heads side by side in each layer;
    # at a batch of 64 their decode reads outweigh what a copy adds, so fairkv copies them
    budgets = [[60_000, 50_000, 2_000, 1_000, 1_000, 3_000, 2_000, 1_000] for _ in range(4)]
    head_map = _map([["full"] * 8] * 4, budgets)
    config = ParallelConfig(gpus=4, balance="fairkv", replicas=2, balance_phase="decode")
    chosen = balance_heads(head_map, SHAPE, config, context=2**17, batch=64)
    uniform = balance_heads(head_map, SHAPE, replace(config, balance="uniform"), context=2**17,
                            batch=64)  # fmt: skip
    assert chosen.phase == "decode" and chosen.loads["decode"]["extra_copies"] > 0
    ranks = {r for e in chosen.head_map.entries for r in e.rank}
    assert ranks <= set(range(4)) and len(ranks) == 4
    for entry in chosen.head_map.entries:  # shares only where a head is copied
        assert len(entry.shares) == (len(entry.rank) if len(entry.rank) > 1 else 0)
        assert not entry.shares or sum(entry.shares) == pytest.approx(1)
    mine, theirs = chosen.loads["decode"], uniform.loads["decode"]
    assert theirs["imbalance_max_over_mean"] > 1.8  # both heavy heads on rank 0
    assert mine["imbalance_max_over_mean"] < 1.2 < theirs["imbalance_max_over_mean"]
    assert mine["step_seconds"] < theirs["step_seconds"] / 1.6
    again = HeadMap.from_dict(json.loads(json.dumps(chosen.head_map.to_dict())))
    assert again.entries == chosen.head_map.entries  # ranks and shares survive JSON
    # one sequence: a 60K-token head reads in about 10 us, less than a copy adds: no copy
    single = balance_heads(head_map, SHAPE, config, context=2**17)
    assert single.loads["decode"]["extra_copies"] == 0


def test_parallel_options_are_checked():
    from headspace import UserError

    for bad in ({"gpus": 0}, {"replicas": -1}, {"balance": "round_robin"},
                {"balance_phase": "train"}):  # fmt: skip
        with pytest.raises(UserError):
            ParallelConfig(**bad)


def test_plan_prints_each_ranks_load_and_the_imbalance_against_uniform(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    scores = [[(layer * 8 + head) % 5 / 4 for head in range(8)] for layer in range(32)]
    Profile("m", 32, 8, scores).save(tmp_path / "profile.json")
    base = ["plan", "--model", str(tmp_path), "--context", "128K", "--gpu-memory", "139GiB",
            "--profile", str(tmp_path / "profile.json"), "--retrieval-heads", "0.5"]  # fmt: skip
    assert main([*base, "--gpus", "4", "--balance", "greedy"]) == 0
    out = capsys.readouterr().out
    assert "balance greedy over 4 GPUs" in out and "balanced: prefill+decode costs" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+[0-3]\s+\d", line)]
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3]
    assert sum(float(r[1]) for r in rows) == pytest.approx(8, abs=0.02)  # kv heads a layer
    decode = next(line for line in out.splitlines() if line.startswith("decode: imbalance"))
    mine, theirs = (float(x) for x in re.findall(r"\d+\.\d{3}", decode))
    assert 1 <= mine < theirs
    assert main([*base, "--gpus", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["balance"]["solver"] == "fairkv"
    assert {r for e in data["head_map"]["entries"] for r in e["rank"]} == {0, 1, 2, 3}
    assert main([*base, "--gpus", "0"]) == 2
    assert "gpus must be" in capsys.readouterr().err


def test_plan_balances_the_measured_budget_shares_of_a_profile(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    shares = [[3.0, 2.2, 0.5, 0.4, 0.3, 0.6, 0.5, 0.5] for _ in range(32)]  # mean 1 a layer
    Profile("m", 32, 8, [[0.0] * 8] * 32, budget_shares={"ada_snapkv 0.25": shares}).save(
        tmp_path / "profile.json"
    )
    base = ["plan", "--model", str(tmp_path), "--context", "128K", "--gpu-memory", "139GiB",
            "--kv-budget", "0.25", "--gpus", "4", "--json"]  # fmt: skip
    assert main([*base, "--kv-policy", "ada_snapkv"]) == 0  # no profile: even budgets
    even = json.loads(capsys.readouterr().out)["balance"]
    assert even["uniform"]["decode"]["imbalance_max_over_mean"] == pytest.approx(1.0)
    profiled = [*base, "--kv-policy", "ada_snapkv", "--profile", str(tmp_path / "profile.json"),
                "--retrieval-heads", "0.5"]  # fmt: skip
    assert main(profiled) == 0
    data = json.loads(capsys.readouterr().out)
    uniform, chosen = data["balance"]["uniform"], data["balance"]["loads"]
    assert uniform["decode"]["imbalance_max_over_mean"] > 1.5  # both heavy heads on rank 0
    # both phases (auto): two heads a rank, as even as uniform's at prefill, a heavy head
    # beside light ones at decode; decode alone evens decode more, prefill much less
    assert chosen["prefill"]["imbalance_max_over_mean"] == pytest.approx(1.0)
    assert chosen["decode"]["imbalance_max_over_mean"] < 1.3
    assert main([*profiled, "--balance-phase", "decode"]) == 0
    decode = json.loads(capsys.readouterr().out)["balance"]["loads"]
    assert decode["decode"]["imbalance_max_over_mean"] < 1.15
    assert decode["prefill"]["imbalance_max_over_mean"] > 1.4
    heavy = [e for e in data["head_map"]["entries"] if e["kv_head"] == 0]
    assert {e["budget"] for e in heavy if e["pattern"] == "full"} == {round(0.25 * 131072 * 3)}
    assert {e["budget"] for e in heavy if e["pattern"] != "full"} <= {1028}  # rings stay

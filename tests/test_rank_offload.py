"""KV in host memory under torchrun: each rank keeps as many of its entries resident as the
plan's pages hold (its copies of shared heads first) and streams the rest of its own heads
from host pages, or attends them in part on the CPU (hybrid); sequences that outgrow an
all-resident pool swap out to host pages and back. Launched as users do (gloo on
the CPU) against one process that keeps everything resident; and the pure arithmetic of
which entries each rank keeps, without a process group."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headspace.engine.ranks import Ranks, own_resident
from headspace.errors import UserError
from headspace.parallel.balance import with_ranks
from headspace.parallel.placement import rank_layout
from headspace.parallel.solvers import solve_layers
from headspace.planner.head_cost import HeadCost
from headspace.planner.head_map import HeadEntry, HeadMap
from headspace.planner.memory import KVSpec
from headspace.planner.plan import plan_batch
from test_parallel_engine import SAMPLED, _case, _check, _uneven, run_cases

RESIDENT = {"num_kv_pages": None}  # one process: everything on the "GPU"


def test_host_memory_two_ranks(wide_llama, prompt, tmp_path):
    """Each rank's heads beyond what its GPU pages hold live in host pages, streamed in (by
    groups, by layers) or attended in part by CPU threads (hybrid): even and uneven maps, a
    batch that reaches the plan, sampled tokens, and decode as the CUDA graphs run it; and
    whole sequences swapped out to host pages and back, even and uneven. One process keeps
    everything resident."""
    cases = [
        {**_case(wide_llama, prompt, {"num_kv_pages": 3, "balance": "uniform", "offload": "head",
                                      "head_group": 1}), "single": RESIDENT},
        {**_case(wide_llama, prompt, {"num_kv_pages": 2, "balance": "random", "offload": "head"},
                 params=SAMPLED), "single": RESIDENT},
        {**_case(wide_llama, prompt, {"num_kv_pages": 4, "balance": "uniform",
                                      "offload": "layer"}), "single": RESIDENT},
        {**_case(wide_llama, prompt, {"num_kv_pages": 3, "balance": "uniform", "offload": "hybrid",
                                      "cpu_share": 0.5, "gpu_window": 16}), "single": RESIDENT},
        {**_case(wide_llama, prompt, {"num_kv_pages": 3, "balance": "random", "offload": "head"}),
         "single": RESIDENT, "batch": [150, 75, 100], "graph_twin": True},
    ]  # fmt: skip
    cases += [
        _swapping(wide_llama, prompt, balance, n) for balance, n in (("uniform", 6), ("random", 9))
    ]
    results = _check(run_cases(2, cases, tmp_path), cases)
    assert _uneven(results[1]["heads"]) and _uneven(results[-1]["heads"])
    tiers = ["stream", "stream", "stream", "hybrid", "stream"]
    for result, tier in zip(results, tiers, strict=False):
        first = result["tiers"][0]  # the longest prompt's plan (each rank's part of it)
        assert 0 < first[tier] < 32 and first["gpu"] + first[tier] == 32, result["tiers"]
    assert results[4]["graphs"]
    for result in results[-2:]:  # pages out to host pages, and all of them back
        assert result["swaps"] and sum(result["swaps"]) == 0, result["swaps"]


def _swapping(model, prompt, balance: str, num_kv_pages: int) -> dict:
    """Five prompts whose 48 new tokens each outgrow a rank's all-resident pool: sequences
    swap out to the rank's host pages and back (one process keeps everything resident)."""
    options = {"num_kv_pages": num_kv_pages, "balance": balance}
    return {**_case(model, prompt, options, params={"max_new_tokens": 48, "ignore_eos": True}),
            "batch": [60, 50, 70, 40, 65], "single": RESIDENT}  # fmt: skip


def test_copies_in_host_memory_three_ranks(wide_llama, prompt, tmp_path):
    """Three ranks over 4 kv heads: each rank computes one head alone and a copy of the
    fourth; the copies keep their places in the GPU pages, the own heads past the plan's
    resident entries stream (or go hybrid); a swapped sequence's copies land in host pages
    after the rank's own heads, and come back. Ranks that stream different numbers of heads
    (greedy: 2, 1 and 1 a layer) decide alike whether a step fits a graph, by the most any
    of them may stream, even where a lowered bound lets the lighter ranks' steps in."""
    options = {"num_kv_pages": 4, "balance": "fairkv", "head_group": 1}
    cases = [
        {**_case(wide_llama, prompt, {**options, "offload": "head"}), "single": RESIDENT},
        {**_case(wide_llama, prompt, {**options, "offload": "hybrid", "cpu_share": 0.5,
                                      "gpu_window": 16}), "single": RESIDENT},
        {**_case(wide_llama, prompt, {"num_kv_pages": 2, "balance": "greedy", "replicas": 0,
                                      "offload": "head"}),
         "single": RESIDENT, "batch": [150, 75, 100], "graph_twin": True,
         "graph_max_bytes": 100_000},
        {**_case(wide_llama, prompt, {"num_kv_pages": 2, "balance": "greedy", "replicas": 0,
                                      "offload": "head"}),
         "single": RESIDENT, "batch": [40, 30], "graph_twin": True},
        _swapping(wide_llama, prompt, "fairkv", 6),  # copies swap after own heads
    ]  # fmt: skip
    results = _check(run_cases(3, cases, tmp_path), cases)
    assert "8 entries copied" in results[-1]["summary"]
    assert results[-1]["swaps"] and sum(results[-1]["swaps"]) == 0
    assert _uneven(results[2]["heads"])
    assert len(set(results[2]["graphs_all"])) == 1  # (collectives would not pair up)
    assert results[3]["graphs_all"] == [True] * 3
    for result, tier in zip(results[:2], ["stream", "hybrid"], strict=True):
        assert "8 entries copied" in result["summary"]
        first = result["tiers"][0]
        assert 0 < first[tier] <= 24 and first["gpu"] + first[tier] == 32, result["tiers"]


def _balanced(num_layers: int, num_kv_heads: int, world: int, costs: list[float],
              replicas: int) -> HeadMap:  # fmt: skip
    head_map = HeadMap.all_gpu(num_layers, num_kv_heads)
    layer_costs = [[HeadCost(c) for c in costs] for _ in range(num_layers)]
    return with_ranks(head_map, solve_layers("fairkv", layer_costs, world, replicas=replicas))


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(2, 4),
    costs=st.lists(st.floats(0.2, 4.0), min_size=4, max_size=4),
    replicas=st.integers(0, 2),
    share=st.floats(0.05, 0.95),
    head_group=st.sampled_from([None, 1, 2]),
    offload=st.sampled_from(["head", "layer", "hybrid"]),
)
def test_spread_fills_each_rank_pages_as_sized(world, costs, replicas, share, head_group,
                                               offload):  # fmt: skip
    """Over random costs (uneven maps, copies) and arenas short of all-resident: every rank
    keeps its copies and exactly as many entries resident as the sized plan's pages hold
    (or all of its own), streams the rest of its own heads in groups no wider than the
    staging slots, and a rank whose copies alone overflow the pages is refused in one line."""
    head_map = _balanced(4, 4, world, costs, replicas)
    layouts = tuple(rank_layout(head_map, r, world) for r in range(world))
    most = max(lay.most_heads for lay in layouts)
    spec = KVSpec(num_layers=4, num_kv_heads=most, head_dim=8, page_size=16, dtype_bytes=2)
    total = 40  # pages of the batch
    arena = int(share * (total + 1) * spec.full_page_bytes)
    try:
        plan = plan_batch(spec, arena, total, offload=offload, head_group=head_group)
    except UserError:
        return  # not even staging fits
    assert plan.staging is not None
    sized = plan.head_map.count("gpu")
    try:
        spread = Ranks(0, layouts, head_map).spread(plan, "the batch")
    except UserError as error:
        assert "--replicas 0" in str(error)
        assert any(sum(map(len, lay.copies)) > sized for lay in layouts)
        return
    assert spread.rank_map is plan.head_map
    for lay in layouts:
        copies = sum(map(len, lay.copies))
        resident = copies + sum(
            1 for layer, own in enumerate(lay.own) for h in own
            if spread.head_map.entry(layer, h).tier == "gpu"
        )  # fmt: skip
        assert resident == min(sized, copies + sum(map(len, lay.own)))
        for layer in range(4):
            for copy in lay.copies[layer]:
                assert spread.head_map.entry(layer, copy.kv_head).tier == "gpu"
            tiers = [spread.head_map.entry(layer, h).tier for h in lay.own[layer]]
            assert tiers == sorted(tiers, key=lambda t: t != "gpu")  # resident first
            groups = {}
            for h in lay.own[layer]:
                entry = spread.head_map.entry(layer, h)
                if entry.tier != "gpu":
                    assert entry.tier == ("hybrid" if plan.offload == "hybrid" else "stream")
                    groups.setdefault(entry.group, []).append(h)
            assert all(len(g) <= plan.staging.group for g in groups.values())


def test_own_resident_gives_back_where_copies_overflow_a_layer():
    """A layer whose copies outnumber the plan's resident places there takes them from the
    layers keeping the most own heads (the last first); copies beyond every place refuse."""
    head_map = _balanced(2, 4, 3, [1.0] * 4, 2)  # each rank: one head alone, a copy of one
    layout = rank_layout(head_map, 0, 3)
    assert [len(c) for c in layout.copies] == [1, 1] and [len(o) for o in layout.own] == [1, 1]

    def sized(*tiers: str) -> HeadMap:  # 2 layers x 2 places, layer-major
        return HeadMap(2, 2, [HeadEntry(i // 2, i % 2, tier=t) for i, t in enumerate(tiers)])

    # layer 1's copy takes the place layer 0 left its own head
    assert own_resident(layout, sized("gpu", "gpu", "stream", "stream"), "x") == [0, 0]
    assert own_resident(layout, sized("gpu", "gpu", "gpu", "gpu"), "x") == [1, 1]
    assert own_resident(layout, sized("gpu", "gpu", "gpu", "stream"), "x") == [1, 0]
    # a rank holding fewer heads in layer 1 than its places there fills layer 0 with them
    ranks = [(0,), (0,), (1,), (2,), (0,), (1,), (1,), (2,)]  # layer-major, per kv head
    uneven = HeadMap(2, 4, [HeadEntry(i // 4, i % 4, rank=r) for i, r in enumerate(ranks)])
    wide_first = rank_layout(uneven, 0, 3)
    assert [len(o) for o in wide_first.own] == [2, 1]
    assert own_resident(wide_first, sized("gpu", "stream", "gpu", "gpu"), "x") == [2, 1]
    starved = sized("stream", "stream", "stream", "gpu")  # one place, two copies
    with pytest.raises(UserError, match="--replicas 0"):
        own_resident(layout, starved, "the batch")

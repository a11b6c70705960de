"""KV in host memory under torchrun: each rank keeps as many of its entries resident as the
plan's pages hold (its copies of shared heads first) and streams the rest of its own heads
from host pages, or attends them in part on the CPU (hybrid); sequences that outgrow an
all-resident pool swap out to host pages and back. Launched as users do (gloo on
the CPU) against one process that keeps everything resident; and the pure arithmetic of
which entries each rank keeps, without a process group."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headspace.api import LLM
from headspace.engine.ranks import Ranks
from headspace.engine.sampling import SamplingParams
from headspace.errors import UserError
from headspace.kv.spec import KVSpec
from headspace.parallel.balance import with_ranks
from headspace.parallel.placement import rank_layout
from headspace.parallel.rank_plan import own_resident
from headspace.parallel.solvers import solve_layers
from headspace.planner.entry_offload import plan_entries
from headspace.planner.head_cost import HeadCost
from headspace.planner.head_map import HeadEntry, HeadMap
from headspace.planner.plan import plan_batch
from test_parallel_engine import (
    FREE_COPIES,
    SAMPLED,
    _case,
    _check,
    _random_profile,
    _uneven,
    run_cases,
)

RESIDENT = {"num_kv_pages": None}  # one process: everything on the "GPU"


def test_host_memory_two_ranks(wide_llama, prompt, tmp_path):
    """Each rank's heads beyond what its GPU pages hold live in host pages, streamed in (by
    groups, by layers) or attended in part by CPU threads (hybrid, at the plan's share: no
    rank searches it, for the ranks would time their steps apart): even and uneven maps, a
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
                                      "gpu_window": 16}), "single": RESIDENT},
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
    assert results[3]["searching"] == [False, False]  # ranks keep the plan's hybrid share
    for result in results[-2:]:  # pages out to host pages, and all of them back
        assert result["swaps"] and sum(result["swaps"]) == 0, result["swaps"]


def _swapping(model, prompt, balance: str, num_kv_pages: int) -> dict:
    """Five prompts whose 48 new tokens each outgrow a rank's all-resident pool: sequences
    swap out to the rank's host pages and back (one process keeps everything resident);
    fairkv with its copies priced free (so this tiny model's heads are copied)."""
    options = {"num_kv_pages": num_kv_pages, "balance": balance}
    options.update(FREE_COPIES if balance == "fairkv" else {})
    return {**_case(model, prompt, options, params={"max_new_tokens": 48, "ignore_eos": True}),
            "batch": [60, 50, 70, 40, 65], "single": RESIDENT}  # fmt: skip


def test_ranks_refuse_host_pages_alike(wide_llama, prompt, tmp_path):
    """One rank's host pages cannot grow (page-locking failed there): when a sequence must
    swap out, and when a plan streams heads, every rank stops with that rank's one-line
    error (none waits on the others), and after the refused swap a request that fits runs
    as one process runs it."""
    cases = [
        {**_swapping(wide_llama, prompt, "uniform", 6), "host_refuses_on_rank": 1, "after": True},
        {**_case(wide_llama, prompt, {"num_kv_pages": 3, "balance": "uniform",
                                      "offload": "head"}), "host_refuses_on_rank": 1},
    ]  # fmt: skip
    swap, stream = run_cases(2, cases, tmp_path, timeout=240)  # a rank left waiting: timeout
    for result in (swap, stream):
        errors = result["errors"]
        assert errors[0] is not None and errors == [errors[0]] * 2, errors
        assert errors[0].endswith("cannot page-lock host memory on this rank"), errors
    assert swap["errors"][0].startswith("no host pages for a swapped-out sequence")
    assert swap["logits"] is not None and stream["logits"] is None  # refused at the plan
    short = SamplingParams(max_new_tokens=8, ignore_eos=True)
    one = LLM(cases[0]["model"], **{**cases[0]["options"], **RESIDENT})  # one process
    expected = one.generate(prompt[:40], short)[0].token_ids
    assert swap["after"] == expected


def test_copies_in_host_memory_three_ranks(wide_llama, prompt, tmp_path):
    """Three ranks over 4 kv heads: each rank computes one head alone and a copy of the
    fourth; the copies keep their places in the GPU pages, the own heads past the plan's
    resident entries stream (or go hybrid); a swapped sequence's copies land in host pages
    after the rank's own heads, and come back. Ranks that stream different numbers of heads
    (greedy: 2, 1 and 1 a layer) decide alike whether a step fits a graph, by the most any
    of them may stream, even where a lowered bound lets the lighter ranks' steps in."""
    options = {"num_kv_pages": 4, **FREE_COPIES, "head_group": 1}
    cases = [
        {**_case(wide_llama, prompt, {**options, "offload": "head"}), "single": RESIDENT},
        {**_case(wide_llama, prompt, {**options, "offload": "hybrid", "cpu_share": 0.5,
                                      "gpu_window": 16}), "single": RESIDENT},
        {**_case(wide_llama, prompt, {"num_kv_pages": 2, "balance": "greedy", "replicas": 0,
                                      "offload": "head", "head_group": 1}),
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
    decided = results[2]["graph_decisions"]  # every choice weighs the same bytes and groups
    assert decided[0] and decided == [decided[0]] * 3
    # the widest rank's groups of one head: 11 under logits' plan (one sequence), 13 under
    # the batch's (its first request decodes while the others prefill, so steps fit a piece)
    assert {groups for _, groups in decided[0]} == {11, 13}
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


def test_budget_entries_in_host_memory_two_ranks(wide_llama, prompt, tmp_path):
    """Per-entry pages (KV budgets, streaming heads) under torchrun when a rank's entries do
    not fit its GPU pages: every rank plans alike, each puts its own heads past the plan's
    resident entries in its host pages (rings stay), compresses them there and streams
    only what each keeps: even and uneven maps, Ada-SnapKV's heads competing across ranks,
    rings beside offloaded heads, sampled tokens, a batch. One process keeps everything
    resident."""
    profile = _random_profile(tmp_path / "profile.json", 8, 4)
    streaming = {"profile": profile, "retrieval_heads": 0.5, "sparse_pattern": "streaming(4,16)"}
    cases = [
        {**_case(wide_llama, prompt, {"num_kv_pages": 3, "kv_budget": 0.5, "kv_policy": "snapkv",
                                      "balance": "uniform"}), "single": RESIDENT},
        {**_case(wide_llama, prompt, {"num_kv_pages": 3, "kv_budget": 0.4,
                                      "kv_policy": "ada_snapkv", "balance": "random",
                                      "replicas": 0}, params=SAMPLED), "single": RESIDENT},
        {**_case(wide_llama, prompt, {**streaming, "num_kv_pages": 3, "kv_budget": 64,
                                      "kv_policy": "ada_snapkv", **FREE_COPIES}),
         "single": RESIDENT, "batch": [150, 75, 100]},
        {**_case(wide_llama, prompt, {**streaming, "num_kv_pages": 3, "kv_budget": 0.5,
                                      "balance": "greedy", "balance_phase": "prefill",
                                      "replicas": 0}), "single": RESIDENT},
        # (balanced at prefill, where a ring attends fewer keys, so that greedy gives the
        # ranks unequal heads: at decode this tiny model's heads cost their rows alike)
    ]  # fmt: skip
    results = _check(run_cases(2, cases, tmp_path), cases)
    assert _uneven(results[1]["heads"]) and _uneven(results[3]["heads"])
    rings = results[2]["summary"]
    assert "streaming(4,16)=16" in rings
    for result in results:
        first = result["tiers"][0]  # the longest prompt's plan: every rank's entries
        assert first["stream"] > 0 and first["gpu"] + first["stream"] == 32, result["tiers"]
        assert all(max(staged) > 0 for staged in result["staged"])  # each rank streamed
    assert results[2]["tiers"][0]["stream"] <= 16  # rings stay in the plane
    staged = [max(s) for s in results[3]["staged"]]  # ranks holding more stream more
    assert staged[0] != staged[1], staged
    for result in results[1::2]:  # uneven: every rank weighs a batch by the same weights
        assert len(set(result["weighed"])) == 1, result["weighed"]


def test_budget_entries_in_host_memory_three_ranks(wide_llama, prompt, tmp_path):
    """Three ranks: copies of a shared head stay in the GPU pages while each rank's own
    heads go to host pages; and a rank holding twice the heads of the others (uniform over
    4 kv heads) offloads some while the others keep all theirs resident."""
    cases = [
        {**_case(wide_llama, prompt, {"num_kv_pages": 3, "kv_budget": 0.5,
                                      "kv_policy": "ada_snapkv", **FREE_COPIES}),
         "single": RESIDENT},
        {**_case(wide_llama, prompt, {"num_kv_pages": 4, "kv_budget": 64, "balance": "uniform"}),
         "single": RESIDENT},
    ]  # fmt: skip
    copied, uneven = _check(run_cases(3, cases, tmp_path), cases)
    assert "8 entries copied" in copied["summary"]
    first = copied["tiers"][0]
    assert 0 < first["stream"] <= 24, first  # at most the 3 x 8 own heads
    assert all(max(staged) > 0 for staged in copied["staged"])
    assert [sum(h) for h in uneven["heads"]] == [16, 8, 8]
    assert uneven["tiers"][0]["stream"] > 0
    assert uneven["staged"][0] and not any(uneven["staged"][1:])  # the others stage nothing


@settings(max_examples=80, deadline=None)
@given(
    world=st.integers(1, 4),
    costs=st.lists(st.floats(0.2, 4.0), min_size=16, max_size=16),
    replicas=st.integers(0, 2),
    rings=st.lists(st.booleans(), min_size=16, max_size=16),
    share=st.floats(0.6, 1.2),
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=3),
    kept=st.floats(0.1, 1.0),
)
def test_entry_plan_places_every_ranks_entries_alike(world, costs, replicas, rings, share,
                                                     lengths, kept):  # fmt: skip
    """The entry planner over each rank's entries (random costs and rings per layer, copies;
    4 layers x 4 kv heads): every rank
    keeps all its entries resident when the fullest fits; else each offloads exactly its
    entries past the plan's resident ones, only its own heads and never a ring, at most the
    staging slot's share per layer, and its resident entries fit the pool beside two
    slots. One part of every entry plans as one process does."""
    layer_costs = [[HeadCost(c) for c in costs[4 * layer : 4 * layer + 4]] for layer in range(4)]
    head_map = with_ranks(HeadMap.all_gpu(4, 4), solve_layers("fairkv", layer_costs, world,
                                                                replicas=replicas))  # fmt: skip
    pattern = [("streaming(4,16)" if ring else "full") for ring in rings]  # layer-major
    head_map = HeadMap(
        4, 4, [replace(e, pattern=pattern[i]) for i, e in enumerate(head_map.entries)]
    )
    layouts = tuple(rank_layout(head_map, r, world) for r in range(world))
    ranks = Ranks(0, layouts, head_map)
    spec = KVSpec(num_layers=4, num_kv_heads=ranks.most_heads, head_dim=8, page_size=16,
                  dtype_bytes=2)  # fmt: skip
    bounds = [max(1, int(kept * n)) for n in lengths]
    per_entry = sum(spec.pages_for(n) for n in lengths)
    fullest = max(sum(lay.layer_heads) for lay in layouts)
    num_pages = int(share * (fullest * per_entry + 1))  # around what the fullest rank needs
    arena = num_pages * spec.entry_page_bytes
    try:
        plan = plan_entries(spec, arena, head_map, lengths, bounds, parts=ranks.entry_parts())
    except UserError:
        return
    counts = ranks.entry_counts(plan.head_map)
    if plan.entry_staging == 0:
        assert all(offloaded == 0 for _, offloaded in counts)
        assert fullest * per_entry < num_pages
        return
    # +1: the plane's last page, where a graph's padding rows of copies write
    assert plan.num_gpu_pages + 2 * plan.entry_staging + 1 <= num_pages
    num_resident = plan.num_gpu_pages // per_entry
    per_layer = plan.entry_staging // sum(spec.pages_for(b) for b in bounds)
    for lay, (resident, _) in zip(layouts, counts, strict=True):
        assert resident == min(num_resident, sum(lay.layer_heads))
        for layer in range(4):
            offloaded = [e for e in head_map.layer(layer)
                         if plan.head_map.entry(layer, e.kv_head).tier == "stream"
                         and e.kv_head in lay.heads(layer)]  # fmt: skip
            assert len(offloaded) <= per_layer
            assert all(e.rank == (lay.rank,) and e.pattern == "full" for e in offloaded)
    if world == 1:  # one part, every entry: as one process plans
        alone = plan_entries(spec, arena, head_map, lengths, bounds)
        assert alone.head_map.entries == plan.head_map.entries
        assert (alone.num_gpu_pages, alone.entry_staging) == (plan.num_gpu_pages,
                                                              plan.entry_staging)  # fmt: skip

"""The planner: hand-checked numbers, budgets never exceeded, clear refusals."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headspace import UserError
from headspace.cli.main import main
from headspace.kv.spec import KVSpec
from headspace.model.config import config_from_dict
from headspace.planner import HeadMap, PlanRequest, make_plan, plan_batch
from headspace.planner.memory import (
    Hardware,
    graph_step_faster,
    head_bytes,
    split_gpu_budget,
    weight_bytes,
)

GiB, MiB = 2**30, 2**20
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 8192, "rope_theta": 500000.0,
}  # fmt: skip
TINY = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 16,
}  # fmt: skip


def test_llama3_8b_at_one_million_tokens_by_hand():
    config = config_from_dict(LLAMA3_8B)
    assert config.kv_bytes_per_token == 128 * 1024  # 2 (K,V) x 32 x 8 x 128 x 2 bytes
    # 8.03e9 parameters: 32 x 218.1M in the layers + 2 x 525.3M embeddings + the final norm
    weights = 2 * (32 * 218_112_000 + 2 * 525_336_576 + 4096)
    assert weight_bytes(config, 2) == weights
    assert head_bytes(config, 2**20, 2) == 512 * MiB  # one (layer, kv head) at 1M: 512 MiB
    plan = make_plan(config, PlanRequest(2**20, 24 * GiB, 200 * GiB, offload="head"))
    # a fifth of the 9.04 GiB left after weights is 11.5K tokens of activations: 8192
    assert plan.prefill_chunk == 8192
    activations = 8192 * 167936 + 4 * 128256
    assert plan.memory["activations"] == plan.memory["allocator_slack"] == activations
    arena = 24 * GiB - weights - 2 * activations - (4 * 128256 + 167936)
    # 8192 pages of 128 tokens; one page of one head is 64 KiB, so a head's 1M tokens are a
    # 512 MiB gather (one head per group) and three staging slots take 1.5 GiB
    assert plan.offload == "head" and plan.head_group == 1 and plan.staging.depth == 3
    staging = 3 * (8192 + 1) * 64 * 1024  # each slot has a scratch page
    assert plan.memory["staging"] == staging
    resident = (arena - staging) // (8193 * 64 * 1024)
    assert resident == 9 and plan.head_map.count("gpu") == 9
    assert plan.head_map.count("stream") == 247
    assert plan.num_gpu_pages == (arena - staging) // (9 * 64 * 1024) - 1
    assert plan.memory["host_kv"] == 128 * GiB  # host pages hold every entry
    assert plan.decode_pcie_floor_ms == pytest.approx(1000 * 247 * 512 * MiB / 54e9)
    assert plan.memory["total_gpu"] <= 24 * GiB


@pytest.mark.parametrize("tokens,group", [(16384, 4), (32768, 2), (65536, 1), (131072, 1)])
def test_a_streamed_group_moves_at_least_32_mib_a_gather(tokens, group):
    """Llama-3-8B, 64 KiB per entry page: a group's history is at least 32 MiB where one
    head's is less (an eager step's host work per group stays under its copy)."""
    spec = KVSpec(32, 8, 128, 128, 2)
    pages = tokens // 128 + 1
    plan = plan_batch(spec, pages * spec.full_page_bytes // 2, pages, offload="head")
    assert plan.head_group == group
    assert group * pages * spec.entry_page_bytes >= 32 * MiB or group == 1


def test_a_decode_step_streams_as_a_graph_unless_the_eager_one_is_faster():
    """Graph: gathers at 0.8 of 54 GB/s; eager: the link's rate, or the host's 48 ms a step
    plus 0.35 ms a group when longer."""
    hw = Hardware()
    assert graph_step_faster(0.4e9, 23, hw)  # 9 ms of gathers, 56 ms of eager host work
    assert graph_step_faster(3.64e9, 111, hw)  # 32K in pairs: 84 ms against 87 ms
    assert not graph_step_faster(4.73e9, 141, hw)  # 64K: 110 ms against 97 ms
    assert not graph_step_faster(16e9, 248, hw)  # 128K, 248 heads: 370 ms against 296 ms
    fast_host = Hardware(eager_group_seconds=0.25e-3)
    assert not graph_step_faster(3.64e9, 111, fast_host)  # 84 ms against 76 ms
    assert graph_step_faster(3.64e9, 111 * 4, fast_host)  # ... not in groups of one head
    assert graph_step_faster(4.73e9, 141, Hardware(eager_group_seconds=0.6e-3))  # a slow host


def test_a_batch_that_fits_is_all_resident_and_takes_the_whole_arena():
    spec = KVSpec(32, 8, 128, 128, 2)
    assert spec.full_page_bytes == 16 * MiB
    plan = plan_batch(spec, 7 * GiB, total_pages=400)
    assert plan.staging is None and plan.head_map.count("stream") == 0
    assert plan.num_gpu_pages == 7 * GiB // (16 * MiB) - 1 == 447  # one scratch page
    assert plan.num_host_pages == 0


def test_streamed_heads_are_the_last_of_each_layer_in_contiguous_groups():
    spec = KVSpec(4, 8, 128, 128, 2)
    plan = plan_batch(spec, 300 * MiB, total_pages=200, head_group=2)
    head_map = plan.head_map
    for layer in range(4):
        resident = head_map.heads(layer, "gpu")
        assert resident == list(range(len(resident)))
        groups = head_map.offloaded_groups(layer)
        assert [h for g in groups for h in g] == list(range(len(resident), 8))
        assert all(g == list(range(g[0], g[0] + len(g))) and len(g) <= 2 for g in groups)


@pytest.mark.parametrize("share", [0.3, 0.55, 0.8, 0.9, 0.95, 0.97, 0.99])
def test_the_layers_with_a_head_fewer_resident_are_spaced_evenly_ending_the_model(share):
    """Llama-3.1-8B's 32 layers x 8 kv heads at 45K tokens, the arena a share of the KV: the
    resident counts differ by one at most, and the layers holding one fewer are spaced
    evenly, the last layer among them, so a streamed head's copy runs beside the layers
    before it."""
    spec = KVSpec(32, 8, 128, 128, 2)
    total_pages = 360
    arena = int(share * total_pages * spec.full_page_bytes)
    head_map = plan_batch(spec, arena, total_pages, offload="head").head_map
    assert 0 < head_map.count("stream") < 256
    counts = [len(head_map.heads(layer, "gpu")) for layer in range(32)]
    assert max(counts) - min(counts) <= 1
    fewer = [layer for layer, n in enumerate(counts) if n == min(counts)]
    if len(fewer) < 32:  # some layers hold one more
        assert fewer[-1] == 31
        gaps = [b - a for a, b in zip([-1, *fewer], fewer, strict=False)]
        assert max(gaps) - min(gaps) <= 1, counts


def test_layer_mode_streams_whole_layers():
    spec = KVSpec(32, 8, 128, 128, 2)
    plan = plan_batch(spec, 7 * GiB, total_pages=1024, offload="layer")
    assert plan.head_group == 8
    for layer in range(32):
        assert len(plan.head_map.heads(layer, "gpu")) in (0, 8)
        assert plan.head_map.offloaded_groups(layer) in ([], [list(range(8))])


def test_a_long_history_is_staged_in_pieces_when_slots_would_crowd_out_the_pool():
    spec = KVSpec(2, 2, 16, 4, 4)  # a page of one entry: 2 x 4 x 16 x 4 = 512 bytes
    plan = plan_batch(spec, 64 * 1024, total_pages=300)
    assert plan.staging.depth == 2 and plan.staging.group == 1
    assert plan.staging.piece_pages == 64 * 1024 // 2 // (2 * 512) - 1 == 31  # half the arena
    assert plan.head_map.count("gpu") == 0  # 300 pages of even one head do not fit


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"context": 2**22, "host_memory": 100 * GiB}, "needs 512.00 GiB of host memory"),
        ({"gpu_memory": int(14.99 * GiB), "weights": "gpu"}, "GPU budget too small"),
        ({"gpu_memory": 2 * GiB}, r"holds the weights \(14.96 GiB\)"),  # streamed too
        ({"offload": "none"}, "allow offload"),
        ({"offload": "sideways"}, "offload must be one of"),
    ],
)
def test_impossible_budgets_raise(kwargs, message):
    request = {"context": 2**20, "gpu_memory": 24 * GiB, "host_memory": 200 * GiB, **kwargs}
    with pytest.raises(UserError, match=message):
        make_plan(config_from_dict(LLAMA3_8B), PlanRequest(**request))


@settings(max_examples=300, deadline=None)
@given(
    layers=st.integers(1, 40), kv_heads=st.sampled_from([1, 2, 4, 8]),
    head_dim=st.sampled_from([64, 128]), page_size=st.sampled_from([16, 128]),
    total_pages=st.integers(1, 20000), arena_mib=st.floats(0.01, 20000),
    offload=st.sampled_from(["auto", "layer", "head", "hybrid"]),
    head_group=st.one_of(st.none(), st.integers(1, 8)),
)  # fmt: skip
def test_plans_fit_the_arena(layers, kv_heads, head_dim, page_size, total_pages, arena_mib,
                             offload, head_group):  # fmt: skip
    spec = KVSpec(layers, kv_heads, head_dim, page_size, 2)
    arena = int(arena_mib * MiB)
    try:
        plan = plan_batch(spec, arena, total_pages, offload=offload, head_group=head_group)
    except UserError:  # only when even the smallest staging (two slots of a page) does not fit
        group = kv_heads if offload == "layer" else min(head_group or 1, kv_heads)
        assert 2 * group * 2 * spec.entry_page_bytes > arena  # two slots of two pages
        return
    resident = plan.head_map.count("gpu")
    staging = plan.staging.num_bytes if plan.staging else 0
    assert (plan.num_gpu_pages + 1) * resident * spec.entry_page_bytes + staging <= arena
    assert resident == 0 or plan.num_gpu_pages >= total_pages  # the batch fits the pool
    assert resident + plan.head_map.num_offloaded == spec.num_entries
    if plan.staging is not None:
        assert plan.num_host_pages == total_pages and plan.staging.piece_pages >= 1
    assert HeadMap.from_dict(json.loads(json.dumps(plan.head_map.to_dict()))) == plan.head_map


@settings(max_examples=100, deadline=None)
@given(context=st.integers(1, 2**21), gpu_gib=st.floats(15.5, 80),
       offload=st.sampled_from(["auto", "layer", "head"]))  # fmt: skip
def test_make_plan_never_exceeds_the_gpu_budget(context, gpu_gib, offload):
    config = config_from_dict(LLAMA3_8B)
    request = PlanRequest(context, int(gpu_gib * GiB), 1 << 50, offload=offload)
    try:
        plan = make_plan(config, request)
    except UserError:
        return
    assert plan.memory["total_gpu"] <= request.gpu_memory


def test_split_refuses_a_budget_that_leaves_nothing_for_kv():
    config = config_from_dict(TINY)
    weights = weight_bytes(config, 4)
    with pytest.raises(UserError, match=r"holds the weights \(957.8 KiB\)"):  # (a unit that fits)
        split_gpu_budget(config, weights + 1000, weights, 512, 4)


def test_plan_cli_prints_the_table_and_json(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    args = ["plan", "--model", str(tmp_path), "--context", "1M", "--gpu-memory", "24GiB",
            "--host-memory", "200GiB"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "KV 128 KiB per token" in out and "offload hybrid (asked: auto)" in out
    assert "weights" in out and "14.96" in out and "128.00" in out and "allocator slack" in out
    # hybrid slots hold what streams: (1 - 0.505) of 8192 pages rounded up, the window's 8
    # and the two the split rounds into; 7 offloaded heads a layer do not fit one group, 4 do
    assert "4 head(s) per streamed group, 3 staging slots of 4069 pages" in out
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["context"] == 2**20 and data["offload"] == "hybrid"
    assert data["memory_bytes"]["host_kv"] == 128 * GiB and data["staging_depth"] == 3


def test_plan_cli_refuses_with_the_numbers(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    code = main(["plan", "--model", str(tmp_path / "config.json"), "--context", "4M",
                 "--gpu-memory", "24GiB", "--host-memory", "100GiB"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == (
        "error: a context of 4194304 tokens needs 512.00 GiB of host memory for its KV pages, "
        "more than the 100.00 GiB host budget"
    )

"""``headspace plan --gpus N`` plans one rank's part as the engine does under torchrun: its
weights (its kv heads and an MLP slice), pages as wide as the widest rank's layer, its share
of the host, and the whole map spread from it; a copied head's KV counted on every rank."""

from __future__ import annotations

import json

import pytest

from headspace.cli.main import main
from headspace.kv.spec import GiB
from headspace.model.config import config_from_dict
from headspace.parallel.rank_plan import page_heads, plan_for_ranks, rank_kv
from headspace.planner import PlanRequest
from headspace.planner.head_map import HeadEntry, HeadMap
from headspace.planner.memory import WeightSpec
from test_planner import LLAMA3_8B

LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672,
              "num_hidden_layers": 80, "num_attention_heads": 64}  # fmt: skip


def test_a_model_one_gpu_cannot_hold_plans_over_eight(capsys, tmp_path):
    """70B's shape at 128K on 141 GiB GPUs: one must stream its layers and put the KV in
    host pages past a small host budget (refused); over eight ranks each holds a kv head a
    layer, an eighth of the MLP and its 5 GiB of KV, all resident."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_70B))
    base = ["plan", "--model", str(tmp_path), "--context", "128K", "--gpu-memory", "141GiB",
            "--host-memory", "16GiB"]  # fmt: skip
    assert main(base) == 2
    assert "host memory" in capsys.readouterr().err
    assert main([*base, "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "per GPU: each of 8 ranks" in out and "offload none" in out
    assert "host budget 2.00 GiB a rank" in out and "predicted (roofline)" not in out
    assert main([*base, "--gpus", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    config = config_from_dict(LLAMA3_70B)
    rank_weights = WeightSpec.of(config, 2, world=8, kv_heads=1).gpu_bytes
    assert data["memory_bytes"]["weights"] == rank_weights < 21 * GiB
    assert data["memory_bytes"]["gpu_kv"] == 5 * GiB  # 80 layers x 1 head x 128K x 512 B
    assert data["host_memory"] == 2 * GiB and "decode_ms" not in data
    assert data["gpus"] == 8 and data["offload"] == "none"


def test_a_rank_that_streams_spreads_to_every_rank_alike():
    """Llama-3-8B at 1M on two 24 GiB GPUs: the widest rank's plan streams heads; spread,
    each rank keeps as many entries resident as that plan, and the table's KV on the GPU is
    that rank's."""
    config = config_from_dict(LLAMA3_8B)
    head_map = HeadMap(32, 8, [HeadEntry(layer, head, rank=(head // 4,))
                               for layer in range(32) for head in range(8)])  # fmt: skip
    request = PlanRequest(2**20, 24 * GiB, 100 * GiB)
    plan = plan_for_ranks(config, request, head_map, 2)
    sized = plan.rank_map
    assert plan.offload != "none" and sized.num_kv_heads == page_heads(head_map, 2) == 4
    resident = [sum(e.tier == "gpu" and e.rank == (r,) for e in plan.head_map.entries)
                for r in (0, 1)]  # fmt: skip
    assert resident == [sized.count("gpu")] * 2
    assert plan.memory["gpu_kv"] == sized.count("gpu") * 2**20 * 2 * 128 * 2
    streamed = {e.group for e in plan.head_map.entries if e.tier != "gpu"}
    assert {g // 8 for g in streamed} == {0, 1}  # each rank its own groups


def test_a_copy_holds_its_heads_whole_kv_on_every_rank():
    entries = [
        HeadEntry(0, 0, rank=(0, 1), shares=(0.5, 0.5)),
        HeadEntry(0, 1, rank=(1,)),
        HeadEntry(0, 2, rank=(0,), budget=100),
        HeadEntry(0, 3, rank=(0,), tier="stream"),
    ]
    head_map = HeadMap(1, 4, entries)
    assert rank_kv(head_map, 2, 1000) == [(2, 1100), (2, 2000)]
    assert rank_kv(head_map, 2, 1000, tier=None) == [(3, 2100), (2, 2000)]


QWEN25_7B = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
             "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
             "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
             "rope_theta": 1e6, "rms_norm_eps": 1e-6}  # fmt: skip


def test_copies_pay_only_where_the_attention_they_move_outweighs_their_price(capsys, tmp_path):
    """One kv head a rank (Qwen2.5-7B's shape over four ranks) under Ada-SnapKV, one head of
    each layer given 2.5 times an even share: placing whole heads cannot level a layer, only
    copies can. A copy repeats its kernel rows and adds a merge and its work per sequence
    (measured end to end at 256 sequences: 89 us beyond its rows). At 1,024 tokens a head
    that outweighs the attention it moves at any batch (measured: 0.61x of uniform with 56
    copies on four GPUs), so the engine's map has none; at 8,192 tokens a head of a 32K
    context and the 256 sequences of FairKV's regime (``balance_batch``), the heavy heads'
    attention dwarfs it: they are copied, and the decode step's slowest ranks wait far less
    than uniform's."""
    from dataclasses import replace

    from headspace.engine.config import EngineConfig
    from headspace.engine.ranks import balanced_map, costed_map
    from headspace.parallel.balance import balance_heads
    from headspace.planner.head_cost import CostShape
    from headspace.planner.profile import Profile, budget_key

    config = config_from_dict(QWEN25_7B)
    profile = Profile("uneven", 28, 4, [[0.5] * 4 for _ in range(28)])
    for budget in (1024, 8192):
        profile.budget_shares[budget_key("ada_snapkv", budget)] = [[2.5, 0.5, 0.5, 0.5]] * 28

    def engine_config(batch: int, budget: int, balance: str = "copy_search") -> EngineConfig:
        return EngineConfig.of(device="cpu", dtype="bfloat16", kv_budget=budget,
                               kv_policy="ada_snapkv", balance=balance, balance_phase="decode",
                               balance_batch=batch)  # fmt: skip

    def copied(batch: int, budget: int, context: int) -> list:
        engine = engine_config(batch, budget)
        head_map = costed_map(config, engine, profile, context)
        mapped = balanced_map(head_map, config, engine, profile, context, 4)
        return [e for e in mapped.entries if len(e.rank) > 1]

    assert copied(1, 1024, 4096) == [] and copied(256, 1024, 4096) == []
    assert copied(1, 8192, 32768) == []
    heavy = copied(256, 8192, 32768)
    assert heavy and {e.kv_head for e in heavy} == {0}  # only the heavy heads are divided

    def decode_step(balance: str) -> float:
        parallel = replace(engine_config(256, 8192, balance).parallel, gpus=4)
        balance_map = balance_heads(costed_map(config, engine_config(256, 8192), profile, 32768),
                                    CostShape.of(config, 2), parallel, context=32768,
                                    batch=parallel.balance_batch, profile=profile)  # fmt: skip
        return balance_map.loads["decode"]["imbalance_max_over_mean"]

    assert decode_step("copy_search") < 0.7 * decode_step("uniform")
    # the same map through ``headspace plan --gpus 4 --balance-batch N`` (plan's defaults
    # are the engine's: with a profile and no --retrieval-heads, every head keeps its budget)
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_7B))
    profile.save(tmp_path / "profile.json")
    base = ["plan", "--model", str(tmp_path), "--context", "32K", "--gpu-memory", "80GiB",
            "--gpus", "4", "--kv-budget", "8192tok", "--kv-policy", "ada_snapkv", "--profile",
            str(tmp_path / "profile.json"), "--balance", "copy_search", "--balance-phase",
            "decode", "--json", "--balance-batch"]  # fmt: skip
    for batch, copies in ((1, 0), (256, sum(len(e.rank) - 1 for e in heavy))):
        assert main([*base, str(batch)]) == 0
        balance = json.loads(capsys.readouterr().out)["balance"]
        assert balance["decode_batch"] == batch
        assert balance["loads"]["decode"]["extra_copies"] == copies


def test_a_solver_that_cannot_search_a_model_is_refused_in_one_line(capsys, tmp_path):
    """exact and copy_search search small layers only: a model of 32 kv heads a layer is
    refused before any layer is solved (under torchrun on every rank alike, so no rank waits
    for a rank 0 that refused), as one line with exit code 2, and the other solvers plan."""
    from headspace.errors import UserError
    from headspace.parallel.balance import check_balance
    from headspace.parallel.config import ParallelConfig

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA3_8B, "num_key_value_heads": 32}))
    base = ["plan", "--model", str(tmp_path), "--context", "4K", "--gpu-memory", "80GiB",
            "--gpus", "2", "--balance"]  # fmt: skip
    for solver, reason in (("exact", "at most 16 heads a layer, got 32"),
                           ("copy_search", "extra copies a layer, got 32 + 2")):  # fmt: skip
        assert main([*base, solver]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and reason in err and "Traceback" not in err
    assert main([*base, "fairkv"]) == 0
    check_balance(ParallelConfig(gpus=2, balance="exact"), 16)  # the largest layer it takes
    with pytest.raises(UserError, match=r"15 \+ 2"):
        check_balance(ParallelConfig(gpus=4, balance="copy_search", replicas=2), 15)

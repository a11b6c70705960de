"""``headspace plan --gpus N`` plans one rank's part as the engine does under torchrun: its
weights (its kv heads and an MLP slice), pages as wide as the widest rank's layer, its share
of the host, and the whole map spread from it; a copied head's KV counted on every rank."""

from __future__ import annotations

import json

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

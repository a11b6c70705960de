"""The planner: hand-checked numbers, budgets never exceeded, clear refusals."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headspace import UserError
from headspace.cli.main import main
from headspace.model.config import config_from_dict
from headspace.planner import HeadMap, PlanRequest, make_plan
from headspace.planner.plan import head_bytes, weight_bytes

GiB = 2**30
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
    assert 2**20 * config.kv_bytes_per_token == 128 * GiB
    # 8.03e9 parameters: 32 x 218.1M in the layers + 2 x 525.3M embeddings + the final norm
    assert weight_bytes(config, 2) == 2 * (32 * 218_112_000 + 2 * 525_336_576 + 4096)
    assert head_bytes(config, 2**20, 2) == 512 * 2**20  # one (layer, kv head) at 1M: 512 MiB
    plan = make_plan(config, PlanRequest(2**20, 24 * GiB, 200 * GiB))
    assert plan.offload == "head" and plan.head_group == 1  # a 512 MiB head is a big copy
    assert plan.prefill_chunk == 8192
    # 24 GiB - 14.96 GiB weights - 2 x 1.28 GiB activations and allocator slack - 1 GiB
    # staging leaves 10 heads
    assert (
        plan.memory["activations"] == plan.memory["allocator_slack"] == 8192 * 167936 + 4 * 128256
    )
    assert plan.head_map.count("gpu") == 10 and plan.head_map.count("stream") == 246
    assert plan.memory["host_kv"] == 246 * 512 * 2**20
    assert plan.memory["gpu_kv"] + plan.memory["host_kv"] == 128 * GiB
    # decode is PCIe-bound: 123 GiB at 54 GB/s
    assert plan.decode_ms == pytest.approx(1000 * 246 * 512 * 2**20 / 54e9)


def test_streaming_prefill_chunk_hides_the_history_reads():
    """At 17 GiB a fifth of the room is a 2048-token chunk; streamed heads need >= 2824
    (610 TFLOP/s / 54 GB/s x 2 bytes / (2 x 4 queries per kv head)), so 4096."""
    config = config_from_dict(LLAMA3_8B)
    no_stream = make_plan(config, PlanRequest(2**13, 17 * GiB, 200 * GiB))
    assert no_stream.offload == "none" and no_stream.prefill_chunk == 2048
    plan = make_plan(config, PlanRequest(2**19, 17 * GiB, 200 * GiB, offload="head"))
    assert plan.prefill_chunk == 4096 and plan.memory["total_gpu"] <= 17 * GiB
    assert plan.head_map.count("gpu") == 1  # 17 - 14.96 - 2 x 0.64 - 0.5 staging: 0.26 GiB
    tight = make_plan(config, PlanRequest(2**19, 16 * GiB, 200 * GiB, offload="head"))
    assert tight.prefill_chunk == 1024  # 4096 and its staging would not fit: a fifth of it
    weights = weight_bytes(config, 2)
    for context, extra in ((2**20, 2 * GiB), (2**19, 1.4 * GiB)):  # 4096 would leave no room
        plan = make_plan(config, PlanRequest(context, int(weights + extra), 200 * GiB))
        assert plan.prefill_chunk < 4096 and plan.memory["staging"] == 2 * head_bytes(
            config, context, 2
        )  # to stage one head: the smaller chunk


def test_tiny_config_by_hand():
    config = config_from_dict(TINY)
    per_head = 2 * 1000 * 16 * 4  # fp32, 1000 tokens
    assert head_bytes(config, 1000, 4) == per_head
    weights = weight_bytes(config, 4)
    assert weights == 4 * (3 * (64 * (128 + 64) + 128 * 64 + 3 * 64 * 96 + 128) + 2 * 64000 + 64)
    request = PlanRequest(1000, weights + 55 * 10**5, 10**9, dtype_bytes=4, offload="head",
                          head_group=1, prefill_chunk=512)  # fmt: skip
    plan = make_plan(config, request)
    # activations: 512 tokens x (4 x (6 x 64 + 3 x 96) + 4 x 8 x 16 x 4) bytes + fp32 logits
    assert plan.memory["activations"] == 512 * (4 * 672 + 2048) + 4 * 1000
    assert plan.memory["allocator_slack"] == plan.memory["activations"]
    free = 55 * 10**5 - 2 * plan.memory["activations"] - 2 * per_head
    assert plan.head_map.count("gpu") == min(6, free // per_head) == 3
    assert plan.head_map.stream_groups(2) == [[h] for h in plan.head_map.heads(2, "stream")]


def test_layer_mode_streams_whole_layers():
    config = config_from_dict(LLAMA3_8B)
    plan = make_plan(config, PlanRequest(2**17, 24 * GiB, 200 * GiB, offload="layer"))
    assert plan.head_group == 8
    for layer in range(32):
        assert len(plan.head_map.heads(layer, "gpu")) in (0, 8)
        assert plan.head_map.stream_groups(layer) in ([], [list(range(8))])


def test_everything_fits_means_no_offload():
    plan = make_plan(config_from_dict(LLAMA3_8B), PlanRequest(32768, 24 * GiB, 64 * GiB))
    assert plan.offload == "none" and plan.head_map.count("stream") == 0
    assert plan.memory["staging"] == 0 and plan.memory["host_kv"] == 0


@pytest.mark.parametrize(
    "request_kwargs,message",
    [
        ({"context": 2**22, "host_memory": 100 * GiB}, "needs 510.00 GiB of host memory"),
        ({"gpu_memory": 10 * GiB}, "GPU budget too small"),
        ({"offload": "none"}, "does not fit"),
        ({"offload": "layer", "context": 2**20}, "staging"),
        ({"offload": "sideways"}, "offload must be one of"),
    ],
)
def test_impossible_budgets_raise(request_kwargs, message):
    kwargs = {"context": 2**20, "gpu_memory": 24 * GiB, "host_memory": 200 * GiB}
    kwargs.update(request_kwargs)
    with pytest.raises(UserError, match=message):
        make_plan(config_from_dict(LLAMA3_8B), PlanRequest(**kwargs))


@settings(max_examples=200, deadline=None)
@given(
    layers=st.integers(1, 40), kv_heads=st.sampled_from([1, 2, 4, 8]),
    group=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([64, 128]),
    context=st.integers(1, 2**21), gpu_gib=st.floats(0.5, 80), offload=st.sampled_from(
        ["auto", "none", "layer", "head"]), head_group=st.one_of(st.none(), st.integers(1, 8)),
)  # fmt: skip
def test_plans_never_exceed_the_gpu_budget(layers, kv_heads, group, head_dim, context, gpu_gib,
                                           offload, head_group):  # fmt: skip
    config = config_from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 1024,
        "intermediate_size": 2816, "num_hidden_layers": layers,
        "num_attention_heads": kv_heads * group, "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
    })  # fmt: skip
    request = PlanRequest(context, int(gpu_gib * GiB), 1 << 50, offload=offload,
                          head_group=head_group)  # fmt: skip
    try:
        plan = make_plan(config, request)
    except UserError:
        return
    assert plan.memory["total_gpu"] <= request.gpu_memory
    per_head = head_bytes(config, context, 2)
    assert plan.memory["gpu_kv"] == plan.head_map.count("gpu") * per_head
    assert plan.head_map.count("gpu") + plan.head_map.count("stream") == layers * kv_heads
    assert HeadMap.from_dict(json.loads(json.dumps(plan.head_map.to_dict()))) == plan.head_map


def test_plan_cli_prints_the_table_and_json(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    args = ["plan", "--model", str(tmp_path), "--context", "1M", "--gpu-memory", "24GiB",
            "--host-memory", "200GiB"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "KV 128 KiB per token" in out and "offload head" in out
    assert "weights" in out and "14.96" in out and "123.00" in out and "allocator slack" in out
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["context"] == 2**20 and data["offload"] == "head"
    assert data["memory_bytes"]["host_kv"] == 246 * 512 * 2**20


def test_plan_cli_refuses_with_the_numbers(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    code = main(["plan", "--model", str(tmp_path / "config.json"), "--context", "4M",
                 "--gpu-memory", "24GiB", "--host-memory", "100GiB"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == (
        "error: a context of 4194304 tokens needs 510.00 GiB of host memory for streamed KV, "
        "more than the 100.00 GiB host budget"
    )

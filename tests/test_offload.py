"""Head-wise offload: every mode and head-group size equals the all-resident run exactly."""

from __future__ import annotations

import pytest
import torch

from headspace import LLM, SamplingParams
from headspace.planner.plan import head_bytes, weight_bytes, working_bytes

CHUNK = 64


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_dir):
    from conftest import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("offload-tiny")
    make_tiny_checkpoint("llama3", path, embedded_dir)
    return path


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    generator = torch.Generator().manual_seed(5)
    return torch.randint(3, 40000, (150,), generator=generator).tolist()


@pytest.fixture(scope="module")
def resident_run(tiny_llama, prompt):
    llm = LLM(str(tiny_llama), prefill_chunk=CHUNK)
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    return llm.logits(prompt), llm.generate(prompt[:40], params)[0].token_ids


def _budget(llm_dir, group: int, resident_heads: int, dtype_bytes: int = 4) -> int:
    """A GPU budget that leaves room for ``resident_heads`` heads beside the staging."""
    config = LLM(str(llm_dir)).engine.model.config
    per_head = head_bytes(config, config.max_context, dtype_bytes)
    return (weight_bytes(config, dtype_bytes) + working_bytes(config, CHUNK, dtype_bytes)
            + 2 * group * per_head + resident_heads * per_head)  # fmt: skip


@pytest.mark.parametrize(
    "offload,group,resident",
    [("head", 1, 2), ("head", 2, 3), ("head", 1, 0), ("layer", 2, 2), ("head", 2, 0)],
)
def test_offload_equals_all_resident(tiny_llama, prompt, resident_run, offload, group, resident):
    budget = _budget(tiny_llama, group, resident)
    llm = LLM(str(tiny_llama), prefill_chunk=CHUNK, offload=offload, head_group=group,
              gpu_memory=budget)  # fmt: skip
    plan = llm.engine.batch.plan
    assert plan is not None and plan.head_map.count("stream") > 0
    assert plan.head_map.count("gpu") == (resident // 2 * 2 if offload == "layer" else resident)
    assert plan.head_group == group
    logits, tokens = resident_run
    assert (llm.logits(prompt) - logits).abs().max().item() <= 1e-5
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    assert llm.generate(prompt[:40], params)[0].token_ids == tokens


def test_streamed_history_is_written_once_per_token(tiny_llama, prompt):
    llm = LLM(str(tiny_llama), prefill_chunk=CHUNK, offload="head", head_group=1,
              gpu_memory=_budget(tiny_llama, 1, 0))  # fmt: skip
    llm.generate(prompt[:100], SamplingParams(max_new_tokens=5, ignore_eos=True))
    host = llm.engine.batch.runner.streamer.host
    assert host.data.shape[0] == llm.engine.batch.plan.head_map.count("stream")
    for tensor in host.data.flatten(0, 1):  # prompt + 4 decoded tokens written, per K and V
        assert tensor[:104].abs().sum(-1).gt(0).all()
        assert tensor[104:].abs().sum().item() == 0  # the rest untouched


def test_embedded_model_with_streamed_heads(embedded_dir):
    ids = LLM().tokenizer("Streaming heads from host memory keeps results exact. " * 30)[
        "input_ids"
    ]
    reference = LLM(prefill_chunk=128).logits(ids)
    config = LLM().engine.model.config
    per_head = head_bytes(config, config.max_context, 4)
    budget = (weight_bytes(config, 4) + working_bytes(config, 128, 4) + 2 * per_head
              + 40 * per_head)  # fmt: skip
    llm = LLM(prefill_chunk=128, offload="head", head_group=1, gpu_memory=budget)
    assert llm.engine.batch.plan.head_map.count("gpu") == 40
    assert (llm.logits(ids) - reference).abs().max().item() <= 1e-4


def test_requests_sharing_a_prefix_match_the_resident_run(tiny_llama, prompt):
    """Found by `eval --compare`: prefix reuse must not hand a streamed head another
    request's history."""
    prompts = [prompt[:100] + [7, 8], prompt[:60] + [9], prompt[:100] + [11, 12, 13]]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    resident = LLM(str(tiny_llama), prefill_chunk=CHUNK, page_size=16).generate(prompts, params)
    llm = LLM(str(tiny_llama), prefill_chunk=CHUNK, page_size=16, offload="head", head_group=1,
              gpu_memory=_budget(tiny_llama, 1, 2))  # fmt: skip
    streamed = llm.generate(prompts, params)
    assert [o.token_ids for o in streamed] == [o.token_ids for o in resident]

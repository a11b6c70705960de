"""A server's warm-up on the GPU: after it, a long request in the offload lane beside a
short one compiles nothing (run on a GPU machine; CI has none)."""

from __future__ import annotations

import pytest
import torch

from gpu_models import arena_budget, make_engine, stepped, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("offload", ["head", "hybrid"])
def test_a_long_request_after_the_offload_lanes_warm_up_compiles_nothing(offload):
    """The warm-up a server runs (a chunk and a piece, a decode batch of two, then the
    offload lane laid out for the whole context): a 900-token request that streams heads
    (or attends them on the CPU) beside a short one then meets no shape, kernel or
    variant it did not compile (torch.compile's frames and Triton's kernels counted; bf16,
    as served)."""
    from headspace.model.compile_meter import COMPILE_METER

    COMPILE_METER.install()
    model = tiny_model("cuda", torch.bfloat16, layers=4)
    engine = make_engine(model, gpu_memory=arena_budget(model, 96 * 1024), offload=offload)
    lines = []
    engine.warm_up(prompt_len=256 + 17, batch=2, report=lines.append, offload=True)
    assert lines[-1] == "warm-up: the offload lane, laid out for the whole context"
    compiled = COMPILE_METER.count
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=generator) for n in (900, 40)]
    tokens, plans = stepped(engine, prompts)
    assert plans[0].head_map.num_offloaded > 0  # the long one in the offload lane
    assert COMPILE_METER.count == compiled
    assert [len(t) for t in tokens] == [64, 64]

"""A server's warm-up on the GPU: after it, a long request in the offload lane beside a
short one compiles nothing, and prompts below the chunk build no cuDNN plan and capture no
decode graph (run on a GPU machine; CI has none)."""

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


def test_prompts_below_the_chunk_after_a_server_warm_up_meet_no_new_plan_or_graph():
    """The warm-up a server runs (``shapes``: a chunk of 256 and 17 tokens in pages of 16,
    decode batches to 4, then every decode graph of its widths and every causal square's
    cuDNN plan): prompts of a few random lengths below the chunk, three at a time, then
    build no cuDNN attention plan and capture no decode step's CUDA graph (the compile
    meter's listener hears neither; bf16, as served). Lengths of exactly their rows (a
    power of two here) run unpadded, another plan's strides, which the warm-up leaves out."""
    from headspace.model.compile_meter import COMPILE_METER

    COMPILE_METER.install()
    model = tiny_model("cuda", torch.bfloat16, layers=4)
    engine = make_engine(model, page_size=16)
    lines = []
    engine.warm_up(prompt_len=256 + 17, batch=4, report=lines.append, offload=True, shapes=True)
    said = [line.split(" (")[0] for line in lines]
    assert any(line.startswith("warm-up: decode graphs of 3 widths, 8 to 32 pages a row, "
                               "batch buckets 1 to 4: ") for line in said)  # fmt: skip
    if torch.cuda.get_device_capability()[0] >= 9:  # (where cuDNN runs)
        assert "warm-up: cuDNN attention plans of 7 causal squares, 4 to 256 rows" in said
    generator = torch.Generator().manual_seed(11)
    lengths = [n for n in torch.randint(3, 256, (6,), generator=generator).tolist() if n & (n - 1)]
    heard = []
    COMPILE_METER.listen(lambda what, seconds: heard.append(what))
    try:
        stepped(engine, [torch.randint(0, 512, (n,), generator=generator) for n in lengths[:3]])
    finally:
        COMPILE_METER.listen(None)
    assert not [what for what in heard
                if what.startswith(("cuDNN attention plan", "decode step CUDA graph"))]  # fmt: skip

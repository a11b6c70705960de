"""Page-locked host memory on the GPU: the transfer kernels over host pages, and decoder
weights streamed from host memory, against their CPU twins or resident runs."""

from __future__ import annotations

import pytest
import torch

from gpu_models import arena_budget, greedy, make_engine, tiny_model
from headspace.engine.hooks import EngineHooks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_transfer_kernels_read_and_write_page_locked_host_pages():
    from headspace.kv.host_store import HostKVArena
    from headspace.kv.spec import KVSpec
    from headspace.kv.transfer import as_heads, copy_pages, write_tokens

    spec = KVSpec(2, 4, 128, 128, 2)
    host = HostKVArena(spec, torch.bfloat16, pin=True, budget=None)
    host.ensure(10)
    assert host.data.is_pinned() and host.num_pages == 15  # half again as spare
    assert host.num_bytes == (15 + 1) * spec.full_page_bytes  # + scratch
    host.data.normal_()
    twin = host.data.clone()
    staging = torch.zeros(2, 3, 6 * 128, 128, device="cuda", dtype=torch.bfloat16)
    pages, heads = torch.tensor([7, 2, 9]), torch.tensor([1, 2, 3])
    copy_pages(host.layer(1), as_heads(staging, True), pages.cuda(), torch.arange(3).cuda(),
               heads.cuda(), torch.arange(3).cuda(), 128)  # fmt: skip
    expected = torch.zeros(2, 3, 6 * 128, 128, dtype=torch.bfloat16)
    copy_pages(twin[1], as_heads(expected, True), pages, torch.arange(3), heads,
               torch.arange(3), 128)  # fmt: skip
    assert torch.equal(staging.cpu(), expected)
    kv = torch.randn(2, 5, 2, 128, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([3, 4, 900, 901, 1279])
    write_tokens(host.layer(0), torch.tensor([0, 3]).cuda(), slots.cuda(), kv)
    torch.cuda.synchronize()
    write_tokens(twin[0], torch.tensor([0, 3]), slots, kv.cpu())
    assert torch.equal(host.data, twin)


def test_a_run_of_pages_moves_in_one_2d_copy_both_ways_on_a_side_stream():
    """``copy_rows`` between page-locked host pages (``[heads, 2, slots, dim]``) and a
    staging slot (``[2, heads, slots, dim]``), as the stream tier moves a run of a head
    group's pages: CUDA's 2-D copy is found, and each head's rows land where a copy a
    row puts them, on the stream it is issued on, in both directions."""
    from headspace.kv.host_store import HostKVArena
    from headspace.kv.spec import KVSpec
    from headspace.kv.transfer import _memcpy_2d, copy_rows

    assert _memcpy_2d() is not None
    host = HostKVArena(KVSpec(2, 5, 64, 16, 2), torch.bfloat16, pin=True, budget=None)
    host.ensure(12)
    host.data.normal_()
    layer = host.layer(1)  # [5 heads, 2, slots, 64]
    slot = torch.zeros(2, 4, 8 * 16, 64, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # heads 1..3, pages 5..7 into slot pages 2..4
        for kv in range(2):
            copy_rows(slot[kv, :3, 2 * 16 : 5 * 16], layer[1:4, kv, 5 * 16 : 8 * 16])
    side.synchronize()
    expected = torch.zeros(slot.shape, dtype=torch.bfloat16)
    for kv in range(2):
        for j in range(3):
            expected[kv, j, 2 * 16 : 5 * 16] = layer[1 + j, kv, 5 * 16 : 8 * 16]
    assert torch.equal(slot.cpu(), expected) and expected.abs().sum() > 0
    before = host.data.clone()
    copy_rows(layer[2:5, 0, 0:32], slot[1, 1:4, 0:32])  # back to the host: V of slot heads
    torch.cuda.synchronize()
    before[1, 2:5, 0, 0:32] = slot[1, 1:4, 0:32].cpu()
    assert torch.equal(host.data, before)


def test_streamed_weights_on_the_gpu_equal_resident_ones():
    """Layers copied on a side stream while the one before computes (compiled blocks,
    eager decode): the same logits and tokens as resident weights decoding eagerly too (a
    CUDA graph's step pads the batch to a bucket, and bf16 GEMMs over other row counts
    round differently: a batch's greedy tokens then part where two logits nearly tie), an
    odd layer count so the slots wrap; the auto mode streams when a budget cannot hold the
    weights."""
    from headspace.engine.weight_stream import WeightStream, streamed_weight_bytes

    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=generator) for n in (700, 90, 300)]
    resident = make_engine(tiny_model("cuda", torch.bfloat16, layers=5), cuda_graph=False)
    logits, tokens = resident.logits(prompts[0].tolist(), 8), greedy(resident, prompts)
    streamed = make_engine(tiny_model("cuda", torch.bfloat16, layers=5), weights="stream")
    stream = streamed.model.layer_source
    assert isinstance(stream, WeightStream) and stream.copy_stream is not None
    assert all(p.device.type == "cpu" and p.is_pinned() for p in streamed.model.layers.parameters())
    assert torch.equal(streamed.logits(prompts[0].tolist(), 8), logits)
    assert greedy(streamed, prompts) == tokens
    model = tiny_model("cuda", torch.bfloat16, layers=5)
    weights = sum(p.nbytes for p in model.parameters())
    auto = make_engine(model, gpu_memory=arena_budget(model, 0) - weights // 2)
    assert streamed_weight_bytes(auto.model) > 0  # its KV tiers differ: bf16 sums too
    auto_logits = auto.logits(prompts[0].tolist(), 8)
    assert (auto_logits - logits).abs().max().item() <= 2e-2 * logits.abs().max().item()


@pytest.mark.parametrize("late", ["copy", "layer"])
def test_streamed_weights_wait_for_their_copies_and_for_the_layers_before(late):
    """Each copy delayed on the copy stream (a layer that did not wait for its copy would
    compute on the slot's previous layer), or each layer delayed on the compute stream (a
    copy that did not wait for the slot's last layer would overwrite it mid-use), through
    ``EngineHooks.weight_delay``: the logits still equal the resident ones."""
    prompt = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(6)).tolist()
    logits = make_engine(tiny_model("cuda", torch.bfloat16, layers=5)).logits(prompt, 4)
    delayed = []

    def delay(what: str, layer: int) -> None:  # on the stream the hook is called on
        if what == late:
            torch.cuda._sleep(2_000_000)  # ~1 ms: far longer than a tiny layer's work
            delayed.append(layer)

    hooks = EngineHooks(weight_delay=delay)
    streamed = make_engine(tiny_model("cuda", torch.bfloat16, layers=5), hooks, weights="stream")
    assert torch.equal(streamed.logits(prompt, 4), logits)
    assert set(delayed) == set(range(5))  # every layer was late

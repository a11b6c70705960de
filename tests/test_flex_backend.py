"""The ``flex`` attention backend: FlexAttention over pages in place (a prefill chunk over its
sequence's pages, a decode step over each sequence's), equal to the fp32 reference alone and
to the reference backend through the engine in every tier mode."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headspace import SamplingParams
from headspace.attention import attend, reference_attention
from headspace.attention.entry_decode import entry_decode
from headspace.attention.flex import (
    chunk_block_mask,
    decode_block_mask,
    flex_attention_dense,
    flex_paged_decode,
    flex_paged_prefill,
)
from headspace.attention.paged import paged_decode_reference
from headspace.kv.spec import padded_length
from test_hybrid import decode_logits
from test_offload import _prompts, make
from test_streaming_heads import _profile

FP32 = 1e-5


@settings(max_examples=30, deadline=None)
@given(num_q=st.integers(1, 40), extra=st.integers(0, 160), causal=st.booleans(),
       padded=st.booleans())  # fmt: skip
def test_dense_flex_equals_the_reference(num_q, extra, causal, padded):
    """Also with K/V padded to the bucket's length, as on a GPU (the padded keys masked)."""
    generator = torch.Generator().manual_seed(num_q * 100 + extra)
    q = torch.randn(4, num_q, 16, generator=generator)
    k, v = torch.randn(2, 2, num_q + extra, 16, generator=generator)
    out, lse = flex_attention_dense(q, k, v, causal=causal, padded=padded)
    ref_out, ref_lse = attend(q, k, v, causal=causal, backend="reference")
    assert (out - ref_out).abs().max() < FP32 and (lse - ref_lse).abs().max() < FP32


def test_dense_lengths_share_a_bucket_up_to_the_next_power_of_two():
    assert [padded_length(n) for n in (1, 128, 129, 4000, 4096, 4097)] == [128, 128, 256, 4096,
                                                                    4096, 8192]  # fmt: skip


def test_paged_decode_stores_the_new_token_and_equals_the_reference():
    generator = torch.Generator().manual_seed(0)
    pool = torch.randn(2, 2, 12 * 8, 16, generator=generator)
    tables = torch.tensor([[3, 1, 7, 0], [5, 2, 0, 0], [4, 0, 0, 0]], dtype=torch.int32)
    lengths = torch.tensor([20, 9, 1])
    q, new = torch.randn(3, 4, 16, generator=generator), torch.randn(2, 3, 2, 16)
    ours, theirs = pool.clone(), pool.clone()
    out, lse = flex_paged_decode(q, ours[0], ours[1], tables, lengths, 8, new_kv=new)
    ref_out, ref_lse = paged_decode_reference(q, theirs[0], theirs[1], tables,
                                              lengths.tolist(), 8, new_kv=new)  # fmt: skip
    assert torch.equal(ours, theirs)  # the new tokens at positions 19, 8 and 0
    assert (out - ref_out).abs().max() < FP32 and (lse - ref_lse).abs().max() < FP32


def test_entry_rows_with_a_ring_index_and_no_token_equal_the_reference():
    generator = torch.Generator().manual_seed(1)
    plane = torch.randn(2, 10 * 4, 8, generator=generator)
    tables = torch.tensor([[2, 5, 0], [7, 0, 0], [1, 3, 9], [0, 0, 0]], dtype=torch.int32)
    lengths = torch.tensor([6, 3, 10, 0], dtype=torch.int32)  # the last row holds nothing
    ring = torch.tensor([2, 2, 9, 0])  # the first row's new token overwrites position 2
    q, new = torch.randn(2, 4, 8, generator=generator), torch.randn(2, 2, 2, 8)
    ours, theirs = plane.clone(), plane.clone()
    out, lse = entry_decode(q, ours[0], ours[1], tables, lengths, 4, new_kv=new,
                            new_index=ring, flex=True)  # fmt: skip
    ref_out, ref_lse = entry_decode(q, theirs[0], theirs[1], tables, lengths, 4, new_kv=new,
                                    new_index=ring, reference=True)  # fmt: skip
    assert torch.equal(ours, theirs)
    assert (out - ref_out).abs().max() < FP32
    assert torch.equal(lse.isinf(), ref_lse.isinf())  # the empty row: lse -inf
    assert (lse - ref_lse)[~lse.isinf()].abs().max() < FP32


def test_paged_prefill_over_prefix_pages_equals_the_reference():
    generator = torch.Generator().manual_seed(2)
    pool = torch.randn(2, 2, 10 * 8, 16, generator=generator)
    pages = torch.tensor([3, 1, 7])  # positions 0..23; a chunk of 9 from position 10
    q = torch.randn(4, 9, 16, generator=generator)
    mask = chunk_block_mask(pages, 10, 9, pool.shape[2], 8)
    out, lse = flex_paged_prefill(q, pool[0], pool[1], mask)
    slots = (pages[:, None] * 8 + torch.arange(8)).flatten()[:19]
    ref_out, ref_lse = reference_attention(q, pool[0][:, slots], pool[1][:, slots], causal=True)
    assert (out - ref_out).abs().max() < FP32 and (lse - ref_lse).abs().max() < FP32


@settings(max_examples=25, deadline=None)
@given(start=st.integers(0, 300), num_q=st.integers(1, 300), page=st.sampled_from([8, 16, 64]))
def test_a_chunks_block_mask_covers_its_causal_pairs_over_any_pages(start, num_q, page):
    """Query blocks of 128 over pages of any size, chunks across page and block boundaries;
    the pages in a shuffled order, a spare page in the pool."""
    generator = torch.Generator().manual_seed(start * 1000 + num_q)
    num_pages = -(-(start + num_q) // page)
    order = torch.randperm(num_pages + 2, generator=generator)[:num_pages]
    pool = torch.randn(2, 2, (num_pages + 2) * page, 16, generator=generator)
    q = torch.randn(4, num_q, 16, generator=generator)
    mask = chunk_block_mask(order, start, num_q, pool.shape[2], page)
    out, lse = flex_paged_prefill(q, pool[0], pool[1], mask)
    slots = (order[:, None] * page + torch.arange(page)).flatten()[: start + num_q]
    ref_out, ref_lse = reference_attention(q, pool[0][:, slots], pool[1][:, slots], causal=True)
    assert (out - ref_out).abs().max() < 1e-4 and (lse - ref_lse).abs().max() < 1e-4


def _both(checkpoint, **options):
    return (make(checkpoint, attention_backend="flex", **options),
            make(checkpoint, attention_backend="reference", **options))  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [
        {},  # resident
        {"arena": 60 * 1024, "offload": "head"},  # streamed from host pages
        {"arena": 60 * 1024, "offload": "hybrid", "cpu_share": 0.5, "gpu_window": 16},
        {"kv_budget": 0.5, "kv_policy": "ada_snapkv"},  # per-entry pages
    ],
)
def test_every_tier_mode_equals_the_reference_backend(tiny_llama, options):
    prompt = _prompts([150], seed=7)[0]
    flex, reference = _both(tiny_llama, **options)
    gap = decode_logits(flex, prompt, 24) - decode_logits(reference, prompt, 24)
    assert gap.abs().max().item() < 1e-4  # every decode step's logits, fp32


def test_patterns_and_batches_with_a_shared_prefix_equal_the_reference(tiny_llama, tmp_path):
    exact = make(tiny_llama)
    profile = _profile(tmp_path / "p.json", exact)
    flex, reference = _both(tiny_llama, profile=profile, retrieval_heads=0.5,
                            sparse_pattern="streaming(4,24)")  # fmt: skip
    prefix = _prompts([90], seed=8)[0]
    prompts = [prefix + tail for tail in _prompts([20, 35, 5], seed=9)]  # pages shared
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ours = [o.token_ids for o in flex.generate(prompts, params)]
    assert ours == [o.token_ids for o in reference.generate(prompts, params)]
    assert ours == [flex.generate(p, params)[0].token_ids for p in prompts]  # one at a time
    gap = decode_logits(flex, prompts[1], 24) - decode_logits(reference, prompts[1], 24)
    assert gap.abs().max().item() < 1e-4


def test_block_masks_list_each_page_once_in_contiguous_indices():
    """The compiled kernel reads block indices row by row whatever their strides (an
    expanded view gave wrong sums on a GPU). A decode step lists every page a sequence
    uses as a masked block (no full block: the decode kernel then splits the sequence's
    own blocks), and a chunk its whole pages before each query block as full ones."""
    tables = torch.tensor([[3, 1, 7, 0], [5, 2, 0, 0], [4, 6, 0, 0]], dtype=torch.int32)
    decode = decode_block_mask(tables, torch.tensor([20, 9, 16]), 8 * 8, 8)
    chunk = chunk_block_mask(torch.tensor([3, 1, 7]), 10, 9, 8 * 8, 8)
    for indices in (decode.kv_indices, chunk.kv_indices, chunk.full_kv_indices):
        assert indices.is_contiguous() and indices.dtype == torch.int32
    assert decode.full_kv_num_blocks is None
    assert decode.kv_num_blocks.flatten().tolist() == [3, 2, 2]
    assert decode.kv_indices[0, 0, 0, :3].tolist() == [3, 1, 7]
    assert chunk.full_kv_num_blocks.flatten().tolist() == [1]  # page 3: positions 0-7


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), num_seqs=st.integers(1, 5), page=st.sampled_from([4, 8]))
def test_the_decode_mask_for_listed_pages_equals_the_exact_one_there(seed, num_seqs, page):
    """The GPU's decode mask (cheap: the last page's bound only) agrees with the exact one
    at every slot of the pages each sequence lists: the only slots the kernel evaluates."""
    generator = torch.Generator().manual_seed(seed)
    num_pages = 6 * num_seqs
    lengths = torch.randint(0, 6 * page + 1, (num_seqs,), generator=generator)
    tables = torch.randperm(num_pages, generator=generator).view(num_seqs, 6).int()
    cheap = decode_block_mask(tables, lengths, num_pages * page, page, listed_only=True)
    exact = decode_block_mask(tables, lengths, num_pages * page, page, listed_only=False)
    zero, slots = torch.tensor(0), torch.arange(num_pages * page)
    for b in range(num_seqs):
        listed = cheap.kv_indices[b, 0, 0, : int(cheap.kv_num_blocks[b, 0, 0])].tolist()
        seen = exact.mask_mod(torch.tensor(b), zero, zero, slots)  # [slots]
        # the pages listed are those the sequence sees a key in, and no more
        assert sorted(listed) == sorted(set((slots[seen] // page).tolist()))
        assert int(seen.sum()) == int(lengths[b])
        for page_id in listed:
            for slot in range(page_id * page, (page_id + 1) * page):
                args = (torch.tensor(b), zero, zero, torch.tensor(slot))
                assert bool(cheap.mask_mod(*args)) == bool(exact.mask_mod(*args))


def test_the_flex_backends_pool_stays_within_int32_indices():
    """A pool past 2**31 elements a K plane (a tiny model on a large GPU) would need the
    int64 decode kernel, which fails to compile: the flex backend's arena stops short of
    it (a page count asked past it is refused in one line), and so do the pages a layer's
    pool holds in offload layouts."""
    from headspace.engine.config import EngineConfig
    from headspace.engine.memory import flex_pool_pages, kv_arena_bytes
    from headspace.errors import UserError
    from headspace.kv.spec import KVSpec
    from headspace.planner.plan import plan_batch

    spec = KVSpec(num_layers=4, num_kv_heads=2, head_dim=32, page_size=64, dtype_bytes=4)
    big = 2**31 // (spec.num_kv_heads * spec.head_dim * spec.page_size) + 1  # pages
    config = EngineConfig.of(num_kv_pages=big, attention_backend="sdpa")
    assert kv_arena_bytes(None, config, spec, 0, 256, 4096) == (big + 1) * spec.full_page_bytes
    with pytest.raises(UserError, match="--num-kv-pages"):  # asked for: refused in a line
        kv_arena_bytes(None, EngineConfig.of(num_kv_pages=big, attention_backend="flex"),
                       spec, 0, 256, 4096)  # fmt: skip
    config = EngineConfig.of(num_kv_pages=flex_pool_pages(spec), attention_backend="flex")
    assert kv_arena_bytes(None, config, spec, 0, 256, 4096) // spec.full_page_bytes - 1 == (
        flex_pool_pages(spec)
    )
    # per-entry pages (budgets) share one plane [2, slots, dim]: a quarter as many here
    plane_pages = 2**31 // (spec.head_dim * spec.page_size) // spec.num_entries
    for backend, budget in (("flex", None), ("sdpa", 0.5)):
        config = EngineConfig.of(num_kv_pages=plane_pages + 8, attention_backend=backend,
                                 kv_budget=budget)  # fmt: skip
        kv_arena_bytes(None, config, spec, 0, 256, 4096)  # within their bounds
    with pytest.raises(UserError, match="--num-kv-pages"):
        config = EngineConfig.of(num_kv_pages=plane_pages + 8, attention_backend="flex",
                                 kv_budget=0.5)  # fmt: skip
        kv_arena_bytes(None, config, spec, 0, 256, 4096)
    # offloaded: one resident head a layer takes twice the pages; capped all the same
    arena = 2 * (flex_pool_pages(spec) + 1) * spec.full_page_bytes
    for cap in (None, flex_pool_pages(spec)):
        plan = plan_batch(spec, arena, 3 * flex_pool_pages(spec), offload="head",
                          max_gpu_pages=cap)  # fmt: skip
        assert plan.head_map.count("gpu") > 0
        assert (plan.num_gpu_pages <= flex_pool_pages(spec)) == (cap is not None)

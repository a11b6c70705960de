"""Attention over the page pool equals the reference on random ragged batches."""

from __future__ import annotations

import pytest
import torch

from headspace.attention import attend, merge_attention, reference_attention
from headspace.attention.paged import (
    flex_paged_attention,
    gather_pages,
    physical_block_mask,
    prefix_block_mask,
)

PAGE = 16
HEADS, KV_HEADS, DIM = 8, 2, 32


def _ragged_batch(seq_lens, q_lens, num_pages=24, seed=0):
    """Dense per-sequence K/V scattered into shuffled pages of a pool."""
    generator = torch.Generator().manual_seed(seed)
    pool = torch.zeros(2, KV_HEADS, num_pages * PAGE, DIM)
    free = torch.randperm(num_pages, generator=generator).tolist()
    max_pages = max(-(-n // PAGE) for n in seq_lens)
    tables = torch.zeros(len(seq_lens), max_pages, dtype=torch.int32)
    dense = []
    for b, length in enumerate(seq_lens):
        kv = torch.randn(2, KV_HEADS, length, DIM, generator=generator)
        for j in range(-(-length // PAGE)):
            page = free.pop()
            tables[b, j] = page
            part = kv[:, :, j * PAGE : (j + 1) * PAGE]
            pool[:, :, page * PAGE : page * PAGE + part.shape[2]] = part
        dense.append(kv)
    q = torch.randn(len(seq_lens), HEADS, max(q_lens), DIM, generator=generator)
    return q, pool, tables, dense


def _expected(q, dense, q_lens):
    outs, lses = [], []
    for b, kv in enumerate(dense):
        out, lse = reference_attention(q[b, :, : q_lens[b]], kv[0], kv[1], causal=True)
        outs.append(out)
        lses.append(lse)
    return outs, lses


CASES = [
    ([5, 37, 70], [1, 1, 1]),  # decode over ragged lengths, pages not multiples of anything
    ([16, 33, 1], [16, 7, 1]),  # prefill chunks appended to prefixes of different lengths
    ([90], [90]),  # one whole prompt
]


@pytest.mark.parametrize("seq_lens,q_lens", CASES)
def test_flex_paged_attention_matches_reference(seq_lens, q_lens):
    q, pool, tables, dense = _ragged_batch(seq_lens, q_lens)
    lens, q_len_t = torch.tensor(seq_lens), torch.tensor(q_lens)
    mask = physical_block_mask(
        tables, lens - q_len_t, q_len_t, lens, q.shape[2], pool.shape[2], PAGE
    )
    out, lse = flex_paged_attention(q, pool[0], pool[1], mask)
    for b, (ref_out, ref_lse) in enumerate(zip(*_expected(q, dense, q_lens), strict=True)):
        assert (out[b, :, : q_lens[b]] - ref_out).abs().max().item() < 1e-5
        assert (lse[b, :, : q_lens[b]] - ref_lse).abs().max().item() < 1e-5


def test_gathered_pages_are_the_dense_sequence():
    seq_lens = [5, 37, 70]
    _, pool, tables, dense = _ragged_batch(seq_lens, [1, 1, 1], seed=1)
    for b, length in enumerate(seq_lens):
        k, v = gather_pages(pool, tables[b], length, PAGE)
        assert torch.equal(k, dense[b][0]) and torch.equal(v, dense[b][1])


def test_chunk_attention_is_diagonal_plus_prefix_pages_merged():
    """The paged prefill split: causal over the chunk's own K/V, flex over the prefix pages."""
    seq_len, num_q = 70, 23
    q, pool, tables, dense = _ragged_batch([seq_len], [num_q], seed=3)
    prefix = torch.tensor([seq_len - num_q])
    mask = physical_block_mask(tables, prefix, torch.tensor([num_q]), prefix, num_q,
                               pool.shape[2], PAGE)  # fmt: skip
    prefix_out, prefix_lse = flex_paged_attention(q, pool[0], pool[1], mask)
    direct = prefix_block_mask(tables[0], seq_len - num_q, num_q, pool.shape[2], PAGE)
    direct_out, direct_lse = flex_paged_attention(q, pool[0], pool[1], direct)
    assert torch.equal(direct_out, prefix_out) and torch.equal(direct_lse, prefix_lse)
    k_new, v_new = dense[0][0][:, -num_q:], dense[0][1][:, -num_q:]
    diag_out, diag_lse = attend(q[0], k_new, v_new, causal=True)
    out, lse = merge_attention([diag_out, prefix_out[0]], [diag_lse, prefix_lse[0]])
    ref_out, ref_lse = reference_attention(q[0], dense[0][0], dense[0][1], causal=True)
    assert (out - ref_out).abs().max().item() < 1e-5
    assert (lse - ref_lse).abs().max().item() < 1e-5


@pytest.mark.parametrize("block_n", [16, 32])
def test_triton_paged_decode_matches_reference(block_n):
    """The paged decode kernel with the fused append (on CPU through Triton's interpreter)."""
    from headspace.attention.triton_decode import paged_decode_attention

    seq_lens = [5, 37, 70, 16]
    q, pool, tables, dense = _ragged_batch(seq_lens, [1] * 4, seed=2)
    if torch.cuda.is_available():
        q, pool, tables = q.cuda(), pool.cuda(), tables.cuda()
        dense = [kv.cuda() for kv in dense]
    new_kv = torch.stack([torch.stack([kv[0][:, -1], kv[1][:, -1]]) for kv in dense], dim=1)
    for b, length in enumerate(seq_lens):  # forget the last token (NaN): the kernel must
        # store it, and attend it once
        page, offset = int(tables[b, (length - 1) // PAGE]), (length - 1) % PAGE
        pool[:, :, page * PAGE + offset] = float("nan")
    out, lse = paged_decode_attention(
        q[:, :, 0], pool[0], pool[1], tables, torch.tensor(seq_lens, device=q.device), PAGE,
        new_kv=new_kv, num_splits=3, block_n=block_n,
    )  # fmt: skip
    for b, (ref_out, ref_lse) in enumerate(zip(*_expected(q, dense, [1] * 4), strict=True)):
        tolerance = 5e-3 if q.is_cuda else 1e-5  # the GPU's float32 dots round like tf32
        assert (out[b] - ref_out[:, 0]).abs().max().item() < tolerance
        assert (lse[b] - ref_lse[:, 0]).abs().max().item() < tolerance
        page, offset = int(tables[b, (seq_lens[b] - 1) // PAGE]), (seq_lens[b] - 1) % PAGE
        assert torch.equal(pool[:, :, page * PAGE + offset], new_kv[:, b])


def test_triton_paged_decode_ring_token_replaces_its_slot():
    """With ``new_index`` (a ring row: the new token over its oldest window token) the kernel
    stores the token there and attends it once, in that token's place; a slice whose only
    key is the new token (the last row's: slices of 32 keys) attends just it."""
    from headspace.attention.triton_decode import paged_decode_attention

    seq_lens = [5, 37, 70, 16, 65]
    q, pool, tables, dense = _ragged_batch(seq_lens, [1] * 5, seed=3)
    generator = torch.Generator().manual_seed(4)
    new_kv = torch.randn(2, len(seq_lens), KV_HEADS, DIM, generator=generator)
    new_index = torch.tensor([2, 36, 33, 0, 64], dtype=torch.int32)  # last slots, and others
    for b, at in enumerate(new_index.tolist()):
        page, offset = int(tables[b, at // PAGE]), at % PAGE
        pool[:, :, page * PAGE + offset] = float("nan")  # what the slot held: not attended
        dense[b][:, :, at] = new_kv[:, b]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, pool, tables, new_kv, new_index = (t.to(device) for t in (q, pool, tables, new_kv,
                                                                 new_index))  # fmt: skip
    out, lse = paged_decode_attention(
        q[:, :, 0], pool[0], pool[1], tables, torch.tensor(seq_lens, device=device), PAGE,
        new_kv=new_kv, new_index=new_index, num_splits=3, block_n=16,
    )  # fmt: skip
    for b, at in enumerate(new_index.tolist()):
        ref_out, ref_lse = reference_attention(q[b, :, :1].cpu(), dense[b][0], dense[b][1])
        assert (out[b].cpu() - ref_out[:, 0]).abs().max().item() < 1e-5
        assert (lse[b].cpu() - ref_lse[:, 0]).abs().max().item() < 1e-5
        page, offset = int(tables[b, at // PAGE]), at % PAGE
        assert torch.equal(pool[:, :, page * PAGE + offset], new_kv[:, b])


@pytest.mark.parametrize("ring", [False, True])
def test_triton_paged_decode_attends_each_copy_range_and_stores_every_token(ring):
    """With ``key_shares`` each (sequence, kv head) row attends only its range of the keys,
    cut from its length and shares inside the kernel as the host cuts them
    (:func:`copy_keys`), and its lse is that range's (-inf, out 0, for an empty range); every
    row stores the new token whether or not its range holds it. The CPU twin
    (``entry_decode`` off the GPU) attends the same ranges."""
    from headspace.attention.entry_decode import entry_decode
    from headspace.attention.triton_decode import paged_decode_attention
    from headspace.parallel.placement import copy_keys

    seq_lens = [5, 37, 70, 16, 65]
    q, pool, tables, dense = _ragged_batch(seq_lens, [1] * 5, seed=5)
    generator = torch.Generator().manual_seed(6)
    new_kv = torch.randn(2, len(seq_lens), KV_HEADS, DIM, generator=generator)
    at = [2, 36, 33, 0, 64] if ring else [n - 1 for n in seq_lens]
    for b, index in enumerate(at):
        dense[b][:, :, index] = new_kv[:, b]
        pool[:, :, int(tables[b, index // PAGE]) * PAGE + index % PAGE] = float("nan")
    # kv head 0: the first of two copies by shares 0.3 / 0.7; kv head 1: the second
    shares = (0.3, 0.7)
    key_shares = torch.tensor([[0.0, 0.3], [0.3, 1.0]], dtype=torch.float64)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    new_index = torch.tensor(at, dtype=torch.int32, device=device) if ring else None
    moved = [t.to(device) for t in (q, pool, tables, new_kv, key_shares)]
    q_d, pool_d, tables_d, new_d, shares_d = moved
    lengths = torch.tensor(seq_lens, device=device)
    out, lse = paged_decode_attention(q_d[:, :, 0], pool_d[0], pool_d[1], tables_d, lengths,
                                      PAGE, new_kv=new_d, new_index=new_index, num_splits=3,
                                      block_n=16, key_shares=shares_d)  # fmt: skip
    group = HEADS // KV_HEADS
    tolerance = 5e-3 if q_d.is_cuda else 1e-5
    for b, length in enumerate(seq_lens):
        for head in range(KV_HEADS):
            lo, hi = copy_keys(length, shares, head, PAGE)
            rows = slice(head * group, (head + 1) * group)
            got_out, got_lse = out[b, rows].cpu().float(), lse[b, rows].cpu()
            if hi == lo:
                assert (got_lse == -torch.inf).all() and (got_out == 0).all()
                continue
            kv = dense[b][:, head : head + 1, lo:hi]
            ref_out, ref_lse = reference_attention(q[b, rows, :1], kv[0], kv[1])
            assert (got_out - ref_out[:, 0]).abs().max().item() < tolerance
            assert (got_lse - ref_lse[:, 0]).abs().max().item() < tolerance
        slot = int(tables[b, at[b] // PAGE]) * PAGE + at[b] % PAGE
        assert torch.equal(pool_d[:, :, slot].cpu(), new_kv[:, b])  # both rows stored it
    # the CPU twin: the same rows as entry rows (one kv head each), shares cycling per head
    # entry rows read one plane: the heads' pools end to end, each row's pages offset to
    # its head's
    plane = torch.cat(pool.unbind(1), dim=1)  # [2, kv_heads x slots, dim]
    offsets = torch.arange(KV_HEADS).repeat(len(seq_lens)) * (pool.shape[2] // PAGE)
    rows_tables = (tables.repeat_interleave(KV_HEADS, 0) + offsets[:, None]).int()
    rows_lengths = torch.tensor(seq_lens).repeat_interleave(KV_HEADS).int()
    rows_index = None if not ring else torch.tensor(at).repeat_interleave(KV_HEADS).int()
    twin_out, twin_lse = entry_decode(q[:, :, 0], plane[0], plane[1], rows_tables, rows_lengths,
                                      PAGE, new_kv=new_kv, new_index=rows_index,
                                      key_shares=key_shares)  # fmt: skip
    assert (twin_out - out.cpu().float()).abs().max().item() < tolerance
    finite = twin_lse.isfinite()
    assert torch.equal(finite, lse.cpu().isfinite())
    assert (twin_lse[finite] - lse.cpu()[finite]).abs().max().item() < tolerance


@pytest.mark.parametrize("shares", [(0.25, 0.5, 0.25), (0.3, 0.3, 0.4), (1 / 3, 1 / 3, 1 / 3)])
def test_triton_copy_ranges_cut_as_the_host_and_tile_every_row(shares):
    """Three copies of a head (one kv head each) over rows of 0-200 keys, ties at half pages
    included, with the new token at the row's end or anywhere in it (a ring): each copy
    attends exactly the keys :func:`copy_keys` gives it (with q = 0 its lse is the log of
    their count and its output their mean position), the copies tile the row, and every
    copy stores the new token."""
    from headspace.attention.triton_decode import paged_decode_attention
    from headspace.parallel.placement import copy_keys, cumulative_shares

    page, dim, copies = 16, 16, len(shares)
    generator = torch.Generator().manual_seed(7)
    lengths = [0, 1, 15, 16, 17, 32, 33, 48, 63, 64, 80, 96, 100, 128]
    lengths += torch.randint(0, 200, (6,), generator=generator).tolist()
    width = max(lengths) // page + 1
    tables = torch.arange(len(lengths) * width, dtype=torch.int32).view(len(lengths), width)
    slots = len(lengths) * width * page
    k = torch.zeros(copies, slots, dim)
    v = torch.zeros(copies, slots, dim)
    v[:, :, 0] = (torch.arange(slots) % (width * page)).float()  # each key's position
    v[:, :, 1] = 1.0
    key_shares = torch.tensor([cumulative_shares(shares, i) for i in range(copies)],
                              dtype=torch.float64)  # fmt: skip
    rows = torch.tensor(lengths)
    ring = torch.tensor([int(torch.randint(0, max(n, 1), (1,), generator=generator))
                         for n in lengths], dtype=torch.int32)  # fmt: skip
    for new_index in (None, ring):
        at = (rows - 1).clamp(min=0) if new_index is None else new_index
        new_kv = torch.zeros(2, len(lengths), copies, dim)
        new_kv[1, :, :, 0], new_kv[1, :, :, 1] = at.float()[:, None], 1.0
        k_run, v_run = k.clone(), v.clone()
        out, lse = paged_decode_attention(torch.zeros(len(lengths), copies, dim), k_run, v_run,
                                          tables, rows, page, new_kv=new_kv,
                                          new_index=new_index, num_splits=3, block_n=16,
                                          key_shares=key_shares)  # fmt: skip
        for s, length in enumerate(lengths):
            cuts = [copy_keys(length, shares, c, page) for c in range(copies)]
            assert sum(hi - lo for lo, hi in cuts) == length
            for c, (lo, hi) in enumerate(cuts):
                count = lse[s, c].exp().item()
                assert abs(count - (hi - lo)) < 1e-3, (length, c, count, lo, hi)
                if hi > lo:
                    assert abs(out[s, c, 0].item() - (lo + hi - 1) / 2) < 1e-3
                else:
                    assert (out[s, c] == 0).all()
            if length:
                slot = int(tables[s, int(at[s]) // page]) * page + int(at[s]) % page
                assert (v_run[:, slot, 0] == at[s]).all() and (v_run[:, slot, 1] == 1).all()

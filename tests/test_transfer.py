"""Moving KV between tiers: the Triton kernels (through Triton's interpreter on the CPU)
equal their torch twins; the paged decode kernel equals its CPU twin on head ranges."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headspace.attention.paged import paged_decode_reference
from headspace.kv.transfer import as_heads, copy_pages, device_ints, write_tokens

triton = pytest.importorskip("triton")


def _tiers(seed: int, heads: int, dim: int, page: int, num_pages: int):
    generator = torch.Generator().manual_seed(seed)
    host = torch.randn(heads, 2, num_pages * page, dim, generator=generator)  # one layer
    gpu = torch.randn(2, heads, num_pages * page, dim, generator=generator)
    return host, gpu


@pytest.mark.parametrize("seed,heads,dim,page", [(0, 4, 16, 8), (1, 3, 32, 16), (2, 8, 64, 4)])
def test_copy_pages_kernel_equals_the_twin(seed, heads, dim, page):
    host, gpu = _tiers(seed, heads, dim, page, num_pages=9)
    generator = torch.Generator().manual_seed(seed)
    src_pages = torch.randperm(9, generator=generator)[:5]
    dst_pages = torch.randperm(9, generator=generator)[:5]
    src_heads = torch.randperm(heads, generator=generator)[:2]
    dst_heads = torch.tensor([1, 0])
    twin_dst = as_heads(gpu.clone(), kv_first=True)
    kernel_dst = as_heads(gpu.clone(), kv_first=True)
    copy_pages(host, twin_dst, src_pages, dst_pages, src_heads, dst_heads, page, kernel=False)
    copy_pages(host, kernel_dst, src_pages, dst_pages, src_heads, dst_heads, page, kernel=True)
    assert torch.equal(twin_dst, kernel_dst)
    for i in range(5):  # and the twin does what it says
        for j in range(2):
            s, d = src_pages[i] * page, dst_pages[i] * page
            expected = host[src_heads[j], :, s : s + page]
            assert torch.equal(twin_dst[dst_heads[j], :, d : d + page], expected)
    untouched = torch.ones(heads, 9, dtype=torch.bool)
    untouched[dst_heads[:, None], dst_pages[None, :]] = False
    original = as_heads(gpu, kv_first=True).unflatten(2, (9, page))
    rows, pages = untouched.nonzero(as_tuple=True)
    assert torch.equal(twin_dst.unflatten(2, (9, page))[rows, :, pages], original[rows, :, pages])


@pytest.mark.parametrize("programs", [1, 4, 1000])
def test_a_fixed_grid_copies_the_first_count_page_pairs_and_no_others(programs):
    """A CUDA graph's gather: any grid (fewer programs than items or more) copies exactly the
    first ``count`` page pairs of every head."""
    host, gpu = _tiers(7, 4, 16, 8, num_pages=9)
    src_pages, dst_pages = torch.tensor([3, 8, 0, 5, 1]), torch.tensor([2, 4, 6, 0, 7])
    src_heads, dst_heads = torch.tensor([3, 1, 2]), torch.tensor([0, 2, 1])
    twin = as_heads(gpu.clone(), kv_first=True)
    copy_pages(host, twin, src_pages[:3], dst_pages[:3], src_heads, dst_heads, 8, kernel=False)
    dst = as_heads(gpu.clone(), kv_first=True)
    copy_pages(host, dst, src_pages, dst_pages, src_heads, dst_heads, 8, kernel=True,
               count=torch.tensor([3]), programs=programs)  # fmt: skip
    assert torch.equal(dst, twin)
    assert not torch.equal(twin, as_heads(gpu, kv_first=True))  # (the copy did something)


@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_write_tokens_kernel_equals_the_twin(num_tokens):
    host, _ = _tiers(3, 4, 16, 8, num_pages=10)
    generator = torch.Generator().manual_seed(num_tokens)
    kv = torch.randn(2, num_tokens, 4, 16, generator=generator)[:, :, 1:3]  # a head range view
    slots = torch.randperm(80, generator=generator)[:num_tokens]
    columns = torch.zeros(num_tokens, 3, dtype=torch.long)
    columns[:, 2] = slots  # a column of a CUDA graph's input rows: strided
    heads = torch.tensor([3, 0])
    twin, kernel = host.clone(), host.clone()
    write_tokens(twin, heads, slots, kv, kernel=False)
    write_tokens(kernel, heads, columns[:, 2], kv, kernel=True)
    assert torch.equal(twin, kernel)
    assert torch.equal(twin[3, :, slots], kv[:, :, 0]) and torch.equal(
        twin[0, :, slots], kv[:, :, 1]
    )
    changed = (twin != host).any(-1).nonzero(as_tuple=True)
    assert set(changed[0].tolist()) <= {0, 3} and set(changed[2].tolist()) <= set(slots.tolist())


@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("count", [None, 2])
def test_paired_copy_and_write_move_one_head_per_pair(kernel, count):
    """Ragged per-head sets (KV budgets): page pair i with head i, token t with head t; with
    a graph's ``count``, the first ``count`` pairs only."""
    host, gpu = _tiers(5, 4, 16, 8, num_pages=9)
    src_heads, src_pages = torch.tensor([2, 2, 0, 3]), torch.tensor([4, 1, 4, 8])
    dst_heads, dst_pages = torch.tensor([0, 1, 1, 3]), torch.tensor([0, 0, 5, 2])
    dst = as_heads(gpu.clone(), kv_first=True)
    copy_pages(host, dst, src_pages, dst_pages, src_heads, dst_heads, 8, kernel=kernel,
               count=None if count is None else torch.tensor([count]), paired=True)  # fmt: skip
    expected = as_heads(gpu.clone(), kv_first=True)
    pairs = zip(src_heads, src_pages, dst_heads, dst_pages, strict=True)
    for sh, sp, dh, dp in list(pairs)[:count]:
        expected[dh, :, dp * 8 : dp * 8 + 8] = host[sh, :, sp * 8 : sp * 8 + 8]
    assert torch.equal(dst, expected)
    kv = torch.randn(2, 5, 1, 16, generator=torch.Generator().manual_seed(6))
    heads, slots = torch.tensor([1, 1, 3, 0, 2]), torch.tensor([3, 60, 3, 17, 71])
    written, expected = host.clone(), host.clone()
    write_tokens(written, heads, slots, kv, kernel=kernel, paired=True)
    for t in range(5):
        expected[heads[t], :, slots[t]] = kv[:, t, 0]
    assert torch.equal(written, expected)


@pytest.mark.parametrize("append", [False, True])
def test_paged_decode_kernel_writes_a_head_range_and_equals_the_twin(append):
    from headspace.attention.triton_decode import paged_decode_attention

    generator = torch.Generator().manual_seed(4)
    page, num_pages, lengths = 16, 12, [35, 1, 64]
    k, v = torch.randn(2, 2, num_pages * page, 16, generator=generator)
    tables = torch.tensor([[5, 2, 9, 0], [7, 0, 0, 0], [1, 3, 4, 11]], dtype=torch.int32)
    q_all = torch.randn(3, 12, 16, generator=generator)  # 6 kv heads' queries; 2 are ours
    q = q_all[:, 4:8]  # kv heads 2 and 3 of the layer, GQA 2:1
    new_kv = torch.randn(2, 3, 2, 16, generator=generator) if append else None
    out_all = torch.zeros(3, 12, 16)
    k_ref, v_ref = k.clone(), v.clone()
    _, lse = paged_decode_attention(q, k, v, tables, torch.tensor(lengths), page,
                                    new_kv=new_kv, out=out_all[:, 4:8])  # fmt: skip
    ref_out, ref_lse = paged_decode_reference(q, k_ref, v_ref, tables, lengths, page,
                                              new_kv=new_kv)  # fmt: skip
    assert torch.allclose(out_all[:, 4:8], ref_out, atol=1e-5)
    assert torch.allclose(lse, ref_lse, atol=1e-5)
    assert out_all[:, :4].abs().sum() == 0 and out_all[:, 8:].abs().sum() == 0
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)  # both appended the same K/V


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 6), width=st.integers(0, 5), data=st.data(),
       dtype=st.sampled_from([torch.int32, torch.long]))  # fmt: skip
def test_int_tables_equal_torchs_from_any_lists(rows, width, data, dtype):
    """Host int tables (each decode step's per-entry lengths go through numpy) equal what
    torch makes of the same lists: rectangular, ragged (refused alike), tuples, scalars."""
    ints = st.integers(-(2**31), 2**31 - 1)
    table = [data.draw(st.lists(ints, min_size=width, max_size=width)) for _ in range(rows)]
    made = device_ints(table, "cpu", dtype)
    assert made.dtype == dtype and torch.equal(made, torch.as_tensor(table, dtype=dtype))
    assert made.shape == (rows, width) or rows == 0
    pairs = [tuple(row) for row in table]
    assert torch.equal(device_ints(pairs, "cpu", dtype), torch.as_tensor(pairs, dtype=dtype))
    assert torch.equal(device_ints([5, 6], "cpu", dtype), torch.tensor([5, 6], dtype=dtype))
    if rows >= 2:  # ragged lists: whatever torch makes of them (it refuses most)
        ragged = [*table[:-1], [*table[-1], 1]]
        try:
            expected = torch.as_tensor(ragged, dtype=dtype)
        except (ValueError, TypeError):
            with pytest.raises((ValueError, TypeError)):
                device_ints(ragged, "cpu", dtype)
        else:
            assert torch.equal(device_ints(ragged, "cpu", dtype), expected)


def test_copy_rows_moves_each_row_of_strided_views():
    """``copy_rows`` on the CPU (the GPU's 2-D copy is tested on a GPU): rows of a host
    layout's head group land in a staging slot's rows, and nothing beside them moves."""
    from headspace.kv.transfer import copy_rows

    host, slot = _tiers(3, 5, 16, 4, num_pages=6)
    before = slot.clone()
    copy_rows(slot[1, 0:3, 8:20], host[2:5, 1, 4:16])
    assert torch.equal(slot[1, 0:3, 8:20], host[2:5, 1, 4:16])
    slot[1, 0:3, 8:20] = before[1, 0:3, 8:20]
    assert torch.equal(slot, before)
    with pytest.raises(AssertionError):
        copy_rows(slot[1, 0:2, 8:20], host[2:5, 1, 4:16])


def test_rows_read_as_contiguous_from_their_strides_alone():
    """Which views ``copy_rows`` may move as one 2-D copy: each row one block, whatever the
    stride between rows; a row with a gap or a transposed row is not."""
    from headspace.kv.transfer import _rows_contiguous

    host, slot = _tiers(3, 5, 16, 4, num_pages=6)  # [heads, 2, slots, dim], [2, heads, ...]
    assert _rows_contiguous(host[2:5, 1, 4:16]) and _rows_contiguous(slot[1, 0:3, 8:20])
    assert _rows_contiguous(host[:, 1, 3:4])  # one slot a row (a length-1 dim)
    assert not _rows_contiguous(host[2:5, :, 4:16])  # K then V: a gap inside each row
    assert not _rows_contiguous(slot[1, 0:3, 8:20, :8])  # part of each token's dims
    assert not _rows_contiguous(slot[1, 0:3, 8:20].transpose(1, 2))

"""Per-head attention patterns: specs, estimation, and block masks equal to their dense masks
(the same attention through FlexAttention as through the dense fp32 twin)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headspace.attention.patterns import estimate
from headspace.attention.reference import reference_attention
from headspace.attention.sparse_prefill import (
    block_maps,
    blockwise_pattern_attention,
    flex_pattern_attention,
    pattern_block_mask,
    sparse_prefill_attention,
)
from headspace.kv.spec import BLOCK, Pattern

MIX = ["full", "streaming(4,100)", "vertical_slash(30,80)", "block_sparse(2)",
       "streaming(0,300)", "vertical_slash(5,64)"]  # fmt: skip


def _qkv(num_heads, num_kv_heads, num_q, num_keys, dim=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_heads, num_q, dim, generator=gen)
    k = torch.randn(num_kv_heads, num_keys, dim, generator=gen)
    v = torch.randn(num_kv_heads, num_keys, dim, generator=gen)
    return q, k, v


def test_patterns_parse_and_print():
    for text in ("full", "streaming(4,1024)", "vertical_slash(1000,6000)", "block_sparse(16)"):
        assert str(Pattern.parse(text)) == text
    assert Pattern.parse(" streaming( 0, 64 )") == Pattern("streaming", (0, 64))
    for bad in ("dense", "streaming(4)", "block_sparse(0)", "full(3)", "streaming(a,b)"):
        with pytest.raises(ValueError):
            Pattern.parse(bad)


@pytest.mark.parametrize(
    "num_q,num_keys,capacity",
    [(300, 300, None), (128, 1000, None), (77, 613, None), (513, 900, None), (1, 450, None),
     (77, 613, 1024), (200, 1700, 2048)],
)  # fmt: skip
def test_block_maps_cover_the_dense_mask_and_full_blocks_are_full(num_q, num_keys, capacity):
    """Chunks starting inside a block, ragged keys, and key tables wider than the keys."""
    q, k, _ = _qkv(6, 2, num_q, num_keys)
    table = estimate([Pattern.parse(p) for p in MIX], q, k, capacity=capacity)
    dense = table.dense()  # [heads, q, keys]
    touched, full = block_maps(table)
    num_qb, num_kb = touched.shape[1:]
    padded = torch.zeros(6, num_qb * BLOCK, num_kb * BLOCK, dtype=torch.bool)
    padded[:, :num_q, :num_keys] = dense
    per_block = padded.view(6, num_qb, BLOCK, num_kb, BLOCK)
    any_allowed = per_block.any(4).any(2)
    valid = torch.zeros_like(padded)
    valid[:, :num_q, :num_keys] = True
    all_allowed = (per_block | ~valid.view_as(per_block)).all(4).all(2)
    assert (touched >= any_allowed).all()  # no allowed pair in a skipped block
    assert (~full | all_allowed).all()  # a full block skips the mask only where it is all true
    assert (touched >= full).all()
    mask = pattern_block_mask(table).to_dense()[0].bool()
    assert torch.equal(mask, touched)


@pytest.mark.parametrize("num_q,num_keys", [(200, 200), (130, 700), (64, 389)])
def test_flex_attention_under_patterns_equals_the_dense_twin(num_q, num_keys):
    """FlexAttention (the GPU's path) and the CPU's blockwise path equal the dense twin."""
    q, k, v = _qkv(6, 2, num_q, num_keys, seed=1)
    table = estimate([Pattern.parse(p) for p in MIX], q, k)
    ref_out, ref_lse = sparse_prefill_attention(q, k, v, table, backend="reference")
    for out, lse in (flex_pattern_attention(q, k, v, table),
                     blockwise_pattern_attention(q, k, v, table)):  # fmt: skip
        torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("sparse", ["streaming(4,100)", "block_sparse(2)", "vertical_slash(9,99)"])
def test_full_kv_heads_take_the_fused_kernel_and_the_rest_flex(sparse):
    """A kv head whose query heads are all full runs the fused causal kernel, the others
    FlexAttention; together they equal the dense twin."""
    q, k, v = _qkv(6, 2, 140, 500, seed=5)
    table = estimate([Pattern()] * 3 + [Pattern.parse(sparse)] * 3, q, k)
    out, lse = sparse_prefill_attention(q, k, v, table)
    ref_out, ref_lse = sparse_prefill_attention(q, k, v, table, backend="reference")
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("sparse", ["streaming(4,100)", "block_sparse(2)", "vertical_slash(9,99)"])
def test_a_tables_own_mask_equals_the_general_one(sparse):
    """A table of one sparse kind (beside full heads) masks by that kind's condition alone,
    allowing exactly what the mask of every kind allows; a mix takes the general mask."""
    q, k, _ = _qkv(6, 2, 200, 700, seed=3)
    table = estimate([Pattern()] * 2 + [Pattern.parse(sparse)] * 4, q, k, capacity=1024)
    assert table.mask.__name__ != "mask_mod"
    heads = torch.arange(6)[:, None, None]
    q_idx, kv_idx = torch.arange(200)[None, :, None], torch.arange(1024)[None, None, :]
    general = table.mask_mod(0, heads, q_idx, kv_idx)
    assert general[2:].any() and not general[2:].all()
    assert torch.equal(table.mask(0, heads, q_idx, kv_idx), general)
    mixed = estimate([Pattern.parse(p) for p in MIX], q, k)
    assert mixed.mask.__name__ == "mask_mod"


def test_full_everywhere_equals_causal_attention_exactly():
    q, k, v = _qkv(4, 2, 150, 420, seed=2)
    table = estimate([Pattern()] * 4, q, k)
    expected = reference_attention(q, k, v, causal=True)
    dense = sparse_prefill_attention(q, k, v, table, backend="reference")
    assert torch.equal(dense[0], expected[0]) and torch.equal(dense[1], expected[1])
    flex = sparse_prefill_attention(q, k, v, table)
    torch.testing.assert_close(flex[0], expected[0], atol=2e-5, rtol=2e-5)


def test_a_streaming_head_over_a_short_context_is_full():
    q, k, _ = _qkv(2, 1, 50, 240)
    short = estimate([Pattern("streaming", (16, 240)), Pattern()], q, k).dense()
    assert torch.equal(short[0], short[1])
    cut = estimate([Pattern("streaming", (16, 100)), Pattern()], q, k).dense()
    assert cut[0].sum() < cut[1].sum()
    assert cut[0, -1, :16].all() and cut[0, -1, -100:].all() and not cut[0, -1, 16:-100].any()


def test_vertical_slash_finds_a_planted_column_and_diagonal():
    """Queries aligned with key 300 (a column, key block 2) and keys aligned with the query
    512 positions later (a diagonal: the last queries, in query block 9, meet it in key
    block 5, block diagonal 4): both are kept, beside the forced first block and the two
    nearest diagonals. The column's mass also marks its own diagonal (9 - 2 = 7)."""
    num_keys, dim = 1280, 32
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(1, num_keys, dim, generator=gen) * 0.1
    q = torch.randn(1, num_keys, dim, generator=gen) * 0.1
    k[0, 300, 0] = 45.0
    q[0, :, 0] += 1.0  # every query looks at key 300
    codes = F.normalize(torch.randn(num_keys - 512, dim - 1, generator=gen), dim=1) * 6.5
    k[0, : num_keys - 512, 1:] = codes
    q[0, 512:, 1:] += codes  # key j matches query j + 512
    table = estimate([Pattern("vertical_slash", (1, 200))], q, k)
    assert table.vertical[0].nonzero().flatten().tolist() == [0, 2]
    assert table.slash[0].nonzero().flatten().tolist() == [0, 1, 4, 7]
    last = table.dense()[0, -1].view(-1, BLOCK)  # the last query sees whole key blocks:
    assert last.all(1).nonzero().flatten().tolist() == [0, 2, 5, 8, 9]  # columns, diagonals
    assert last.sum() == 5 * BLOCK


def test_block_sparse_keeps_the_first_the_diagonal_and_the_best_block():
    num_keys, dim = 640, 16
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(1, num_keys, dim, generator=gen) * 0.1
    q = torch.randn(1, 256, dim, generator=gen) * 0.1
    k[0, 2 * BLOCK : 3 * BLOCK, 0] = 5.0  # key block 2 matches every query
    q[0, :, 0] = 5.0
    blocks = estimate([Pattern("block_sparse", (3,))], q, k).blocks[0]  # queries 384..639
    assert blocks.shape == (2, 5)
    assert blocks[:, 0].all() and blocks[:, 2].all()  # the first and the planted block
    assert blocks[0, 3] and blocks[1, 4]  # each query block's diagonal
    assert blocks.sum(1).tolist() == [3, 3]


@pytest.mark.parametrize("pattern", ["block_sparse(1)", "vertical_slash(1,1)", "streaming(0,1)"])
@pytest.mark.parametrize("num_q,num_keys", [(64, 448), (200, 330), (128, 128), (1, 77)])
def test_every_query_sees_its_own_key_under_the_sparsest_patterns(pattern, num_q, num_keys):
    """Chunks that start inside a block included: no query row is left without keys."""
    q, k, _ = _qkv(2, 1, num_q, num_keys, seed=7)
    dense = estimate([Pattern.parse(pattern)] * 2, q, k).dense()  # [heads, q, keys]
    own = torch.arange(num_q) + num_keys - num_q
    assert dense[:, torch.arange(num_q), own].all()


def test_tables_keep_one_shape_per_padded_chunk_and_capacity():
    """A compiled kernel is specialised on the tables' shapes: chunks of different lengths
    that pad to the same size share them."""
    shapes = set()
    for num_q, num_keys in [(300, 1836), (400, 1900), (260, 1800), (512, 2048)]:
        q, k, _ = _qkv(2, 1, num_q, num_keys)
        table = estimate([Pattern.parse("block_sparse(2)")] * 2, q, k, capacity=2048)
        shapes.add((table.blocks.shape, table.vertical.shape))
    assert len(shapes) == 1

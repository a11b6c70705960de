"""Prefill attention under per-head patterns: a FlexAttention BlockMask built from block
indices (no dense mask is evaluated, so it is cheap at any length), and its dense twin.

Blocks are 128 queries by 128 keys. A block where some query of a head may see some key is
computed with the pattern's mask function (``partial``); a block where every query sees every
key skips it (``full``); the rest are skipped. Which blocks a pattern touches follows from its
tables: prefix sums over a head's kept columns and diagonals count, for each block, the
columns and diagonals that cross it.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from headspace.attention import attend
from headspace.attention.patterns import BLOCK, KIND_IDS, HeadPatterns
from headspace.attention.reference import reference_attention


def block_maps(table: HeadPatterns) -> tuple[torch.Tensor, torch.Tensor]:
    """``(touched, full)``, each ``[heads, query blocks, key blocks]`` bool: blocks where the
    mask allows some (query, key) pair, and blocks where it allows all of them."""
    device, num_q, num_keys = table.kind.device, table.num_queries, table.num_keys
    num_qb, num_kb = -(-num_q // BLOCK), -(-num_keys // BLOCK)
    qb, kb = torch.arange(num_qb, device=device), torch.arange(num_kb, device=device)
    q_lo = (table.q_start + qb * BLOCK)[None, :, None]  # first and last query of a block
    q_hi = (table.q_start + torch.clamp((qb + 1) * BLOCK, max=num_q) - 1)[None, :, None]
    k_lo = (kb * BLOCK)[None, None, :]
    k_hi = (torch.clamp((kb + 1) * BLOCK, max=num_keys) - 1)[None, None, :]
    causal_touched, causal_full = k_lo <= q_hi, k_hi <= q_lo
    sink, window = table.sink[:, None, None], table.window[:, None, None]
    streaming_touched = causal_touched & ((k_lo < sink) | (k_hi > q_lo - window))
    streaming_full = causal_full & ((k_hi < sink) | (k_lo > q_hi - window))
    # columns and diagonals crossing a block: key columns k_lo..k_hi, offsets q_lo-k_hi..q_hi-k_lo
    columns = _count(table.vertical, k_lo.expand(-1, num_qb, -1), k_hi.expand(-1, num_qb, -1))
    diagonals = _count(table.slash, (q_lo - k_hi).clamp(min=0), (q_hi - k_lo).clamp(min=-1))
    lines_touched = causal_touched & ((columns > 0) | (diagonals > 0))
    blocks = table.blocks > 0
    kind = table.kind[:, None, None]
    is_kind = {name: kind == KIND_IDS[name] for name in KIND_IDS}
    touched = (is_kind["full"] & causal_touched) | (is_kind["streaming"] & streaming_touched)
    touched |= (is_kind["vertical_slash"] & lines_touched) | (is_kind["block_sparse"] & blocks
                                                             & causal_touched)  # fmt: skip
    full = (is_kind["full"] & causal_full) | (is_kind["streaming"] & streaming_full)
    full |= is_kind["block_sparse"] & blocks & causal_full
    return touched, full


def _count(kept: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Entries of ``kept [heads, n]`` between ``lo`` and ``hi`` inclusive, per block."""
    prefix = torch.nn.functional.pad((kept > 0).int().cumsum(1), (1, 0))  # kept before i
    size = kept.shape[1]
    heads = torch.arange(kept.shape[0], device=kept.device)[:, None, None]
    high = prefix[heads, (hi + 1).clamp(0, size).expand(kept.shape[0], -1, -1)]
    low = prefix[heads, lo.clamp(0, size).expand(kept.shape[0], -1, -1)]
    return (high - low).clamp(min=0)


def _indices(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts [1, heads, query blocks], indices [1, heads, query blocks, key blocks])``:
    the key blocks set in each row, first."""
    counts = blocks.sum(-1, dtype=torch.int32)
    order = blocks.to(torch.int8).argsort(dim=-1, descending=True, stable=True)
    return counts[None], order.to(torch.int32)[None]


def pattern_block_mask(table: HeadPatterns) -> BlockMask:
    """The chunk's BlockMask under ``table``'s patterns (batch 1, one row per query head)."""
    touched, full = block_maps(table)
    counts, indices = _indices(touched & ~full)
    full_counts, full_indices = _indices(full)
    return BlockMask.from_kv_blocks(
        counts, indices, full_counts, full_indices, BLOCK_SIZE=(BLOCK, BLOCK),
        mask_mod=table.mask_mod, seq_lengths=(table.num_queries, table.num_keys),
    )  # fmt: skip


# the pattern's table loads take shared memory beside the tiles: smaller tiles than the
# default (128 x 128, 3 stages) fit a Hopper SM's 227 KiB
KERNEL_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2, "num_warps": 4}


@functools.cache
def _compiled_flex():
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
    return torch.compile(flex_attention, dynamic=False)


def sparse_prefill_attention(
    q: torch.Tensor,  # [heads, queries, dim]: a chunk at positions keys - queries ..
    k: torch.Tensor,  # [kv_heads, keys, dim]: every key up to the chunk's last
    v: torch.Tensor,
    table: HeadPatterns,
    *,
    scale: float | None = None,
    backend: str = "flex",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the chunk under its heads' patterns: ``out [heads, queries, dim]`` in q's
    dtype and ``lse [heads, queries]`` fp32 (a row with no visible key: 0 and -inf).
    ``backend="reference"`` is the dense fp32 twin (the mask evaluated in full). Where all
    query heads of a kv head are ``full``, they take the fused causal kernel (cuDNN on a
    GPU) and only the others FlexAttention."""
    if backend == "reference":
        return reference_attention(q, k, v, scale=scale, mask=table.dense())
    group = q.shape[0] // k.shape[0]
    full = (table.kind == KIND_IDS["full"]).view(k.shape[0], group)
    if full.any() and (full.all(1) | ~full.any(1)).all():  # each kv head all full or none
        kv_full = full[:, 0]
        heads = kv_full.repeat_interleave(group)
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        out[heads], lse[heads] = attend(q[heads], k[kv_full], v[kv_full], causal=True,
                                        scale=scale)  # fmt: skip
        if not kv_full.all():
            out[~heads], lse[~heads] = flex_pattern_attention(q[~heads], k[~kv_full], v[~kv_full],
                                             table.select(~heads), scale)  # fmt: skip
        return out, lse
    return flex_pattern_attention(q, k, v, table, scale)


def flex_pattern_attention(q, k, v, table: HeadPatterns, scale: float | None = None):
    """Every head through FlexAttention under ``table`` (compiled on a GPU)."""
    fn = _compiled_flex() if q.is_cuda else flex_attention
    options = KERNEL_OPTIONS if q.is_cuda else None
    out, aux = fn(q[None], k[None], v[None], block_mask=pattern_block_mask(table), scale=scale,
                  enable_gqa=True, return_aux=AuxRequest(lse=True),
                  kernel_options=options)  # fmt: skip
    return out[0], aux.lse[0]

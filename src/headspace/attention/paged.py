"""Attention over the paged pool with FlexAttention, and its dense CPU twin.

The mask is written for the *logical* layout (each sequence's keys at positions 0..len-1,
causal for queries that end the sequence), built as a BlockMask with the page size as key
block, then converted to *physical* pages: block indices go through the block table and the
mask function maps a physical slot back to its logical position. No page is ever gathered
into a dense copy on this path.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import (
    AuxRequest,
    BlockMask,
    create_block_mask,
    flex_attention,
)

from headspace.kv.paged_store import token_slots

Q_BLOCK = 128


def _logical_mask(q_starts: torch.Tensor, q_lens: torch.Tensor, kv_lens: torch.Tensor):
    """Query ``i`` of sequence ``b`` sits at ``q_start + i``; it sees keys up to its position
    and below ``kv_len`` (causal over the sequence, or a prefix only)."""

    def mask_mod(b, h, q_idx, kv_idx):
        visible = (kv_idx <= q_starts[b] + q_idx) & (kv_idx < kv_lens[b])
        return visible & (q_idx < q_lens[b])

    return mask_mod


def physical_block_mask(
    block_tables: torch.Tensor,  # [seqs, max_pages] int32, pages in logical order (pad: any)
    q_starts: torch.Tensor,  # [seqs] position of each sequence's first query
    q_lens: torch.Tensor,  # [seqs] queries per sequence
    kv_lens: torch.Tensor,  # [seqs] keys per sequence that may be seen
    num_queries: int,  # padded query length
    num_slots: int,  # pages in the pool times page size
    page_size: int,
) -> BlockMask:
    """The BlockMask of paged attention, in physical slot coordinates.

    Causal paged attention: ``q_starts = kv_lens - q_lens``. Attention of a chunk to the
    prefix before it: ``q_starts = kv_lens = prefix length``.
    """
    num_seqs, max_pages = block_tables.shape
    device = block_tables.device
    logical_mask = _logical_mask(q_starts, q_lens, kv_lens)
    logical = create_block_mask(
        logical_mask, num_seqs, None, num_queries, max_pages * page_size, device=device,
        BLOCK_SIZE=(Q_BLOCK, page_size),
    )  # fmt: skip
    tables = block_tables.long()
    num_pages = num_slots // page_size
    logical_page = torch.full((num_seqs, num_pages), -1, dtype=torch.long, device=device)
    pages_used = (kv_lens + page_size - 1) // page_size  # [seqs]
    used = torch.arange(max_pages, device=device)[None, :] < pages_used[:, None]
    rows = torch.arange(num_seqs, device=device)[:, None].expand_as(tables)
    logical_page[rows[used], tables[used]] = torch.arange(max_pages, device=device).expand_as(
        tables
    )[used]

    def physical_mask(b, h, q_idx, slot):
        page = logical_page[b, slot // page_size]
        return (page >= 0) & logical_mask(b, h, q_idx, page * page_size + slot % page_size)

    def to_physical(indices: torch.Tensor | None) -> torch.Tensor | None:
        """Logical block indices -> pages, widened to one column per page of the pool."""
        if indices is None:
            return None
        pages = torch.gather(tables[:, None, None, :].expand(*indices.shape[:3], -1), 3,
                             indices.long())  # fmt: skip
        wide = torch.zeros(*indices.shape[:3], num_pages, dtype=torch.int32, device=device)
        wide[..., : pages.shape[-1]] = pages
        return wide

    return BlockMask.from_kv_blocks(
        logical.kv_num_blocks, to_physical(logical.kv_indices),
        logical.full_kv_num_blocks, to_physical(logical.full_kv_indices),
        BLOCK_SIZE=(Q_BLOCK, page_size), mask_mod=physical_mask,
        seq_lengths=(num_queries, num_slots),
    )  # fmt: skip


def prefix_block_mask(
    pages: torch.Tensor,  # [pages] int, one sequence's pages in logical order
    prefix: int,  # keys visible to every query: positions 0 .. prefix-1
    num_queries: int,  # padded query length
    num_slots: int,
    page_size: int,
) -> BlockMask:
    """The BlockMask of queries attending a sequence's first ``prefix`` tokens, built from
    block indices directly (no dense mask is evaluated: cheap at any length)."""
    device = pages.device
    num_full, partial = divmod(prefix, page_size)
    num_q_blocks = -(-num_queries // Q_BLOCK)
    num_pages = num_slots // page_size

    def rows(page_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        indices = torch.zeros(1, 1, num_q_blocks, num_pages, dtype=torch.int32, device=device)
        indices[..., : len(page_ids)] = page_ids.to(torch.int32)
        counts = torch.full((1, 1, num_q_blocks), len(page_ids), dtype=torch.int32, device=device)
        return counts, indices

    used = num_full + (1 if partial else 0)
    full_counts, full_indices = rows(pages[:num_full])
    counts, indices = rows(pages[num_full:used])
    logical_page = torch.full((num_pages,), -1, dtype=torch.long, device=device)
    logical_page[pages[:used].long()] = torch.arange(used, device=device)
    prefix_t = torch.tensor(prefix, device=device)  # a tensor: no recompile per prefix

    def prefix_mask(b, h, q_idx, slot):  # exact everywhere; blocks only skip work
        page = logical_page[slot // page_size]
        return (page >= 0) & (page * page_size + slot % page_size < prefix_t)

    return BlockMask.from_kv_blocks(
        counts, indices, full_counts, full_indices, BLOCK_SIZE=(Q_BLOCK, page_size),
        mask_mod=prefix_mask, seq_lengths=(num_queries, num_slots),
    )  # fmt: skip


@functools.cache
def _compiled_flex():
    # one compile per shape (padded queries, resident heads of a layer, pool slots); past the
    # limit dynamo would fall back to the eager kernel, which materialises every score and
    # evaluates the mask at every slot (where a decode mask exact only in its listed pages
    # is wrong): limits far past a run's shapes (dense lengths share power-of-two buckets)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 1024)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4096)
    return torch.compile(flex_attention, dynamic=False)


def flex_paged_attention(
    q: torch.Tensor,  # [seqs, heads, queries, dim] (padded per sequence)
    k: torch.Tensor,  # [kv_heads, slots, dim]: the pool
    v: torch.Tensor,
    block_mask: BlockMask,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention over pages: ``out [seqs, heads, queries, dim]`` and ``lse [seqs, heads, q]``.

    Compiled on GPU; on CPU the eager (unfused) FlexAttention runs, for tests.
    """
    fn = _compiled_flex() if q.is_cuda else flex_attention
    out, aux = fn(q, k[None], v[None], block_mask=block_mask, scale=scale, enable_gqa=True,
                  return_aux=AuxRequest(lse=True))  # fmt: skip
    return out, aux.lse


def gather_pages(
    store_kv: torch.Tensor,  # [2, kv_heads, slots, dim]: one layer of the pool
    pages: torch.Tensor,  # [pages] of one sequence, in logical order
    length: int,
    page_size: int,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K and V ``[kv_heads, length - start, dim]`` of a sequence's tokens ``start ..
    length - 1``."""
    positions = torch.arange(start, length, device=store_kv.device)
    slots = token_slots(pages, positions, page_size)
    kv = store_kv.index_select(2, slots)
    return kv[0], kv[1]


def paged_decode_reference(
    q: torch.Tensor,  # [seqs, heads, dim]
    k: torch.Tensor,  # [kv_heads, slots, dim]
    v: torch.Tensor,
    block_tables: torch.Tensor,  # [seqs, max_pages]
    lengths: list[int],  # valid keys per sequence (the new token included)
    page_size: int,
    *,
    new_kv: torch.Tensor | None = None,  # [2, seqs, kv_heads, dim], stored at length - 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU twin of ``paged_decode_attention``: store ``new_kv``, then gather each
    sequence's pages and attend with the fp32 reference. Returns ``out [seqs, heads, dim]``
    and ``lse [seqs, heads]``."""
    from headspace.attention.cpu_decode import cpu_paged_decode_reference

    if new_kv is not None:
        for row, length in enumerate(lengths):
            slot = token_slots(block_tables[row], torch.tensor(length - 1), page_size)
            k[:, slot], v[:, slot] = new_kv[0, row], new_kv[1, row]
    ends = torch.tensor(lengths, dtype=torch.int32)
    out, lse = cpu_paged_decode_reference(q, k, v, block_tables, ends, page_size)
    return out.to(q.dtype), lse


def paged_token_slots(block_tables: torch.Tensor, width: int, page_size: int) -> torch.Tensor:
    """Slots ``[seqs, width]`` (int64) of each sequence's first ``width`` keys."""
    offsets = torch.arange(width, device=block_tables.device)
    pages = block_tables.long().gather(1, (offsets // page_size).expand(len(block_tables), -1))
    return pages * page_size + offsets % page_size


def paged_token_scores(
    q: torch.Tensor,  # [seqs, heads, dim], one query token per sequence
    k: torch.Tensor,  # [kv_heads, slots, dim]
    slots: torch.Tensor,  # [seqs, width] from paged_token_slots
    scale: float | None = None,
) -> torch.Tensor:
    """Scaled scores ``scale q.k`` of the keys at ``slots``, fp32 ``[seqs, heads, width]``
    (a few hundred keys per sequence: plain torch)."""
    num_seqs, num_heads, dim = q.shape
    num_kv_heads, width = k.shape[0], slots.shape[1]
    scale = dim**-0.5 if scale is None else scale
    keys = k[:, slots].float()  # [kv_heads, seqs, width, dim]
    queries = q.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, dim)
    scores = torch.einsum("skgd,kswd->skgw", queries, keys)
    return scores.reshape(num_seqs, num_heads, width) * scale


def paged_token_probs(
    q: torch.Tensor,  # [seqs, heads, dim]
    k: torch.Tensor,  # [kv_heads, slots, dim]
    block_tables: torch.Tensor,  # [seqs, max_pages] int32
    lengths: torch.Tensor,  # [seqs] keys per sequence
    width: int,  # at least the longest sequence
    page_size: int,
    lse: torch.Tensor,  # [seqs, heads] natural-log normaliser of the weights
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax weights ``exp(scale q.k - lse)`` of each sequence's keys, fp32 ``[seqs, heads,
    width]`` (0 past a sequence's length): which keys a decode step attended to."""
    slots = paged_token_slots(block_tables, width, page_size)
    probs = torch.exp(paged_token_scores(q, k, slots, scale) - lse.float()[..., None])
    offsets = torch.arange(width, device=q.device)
    return probs.masked_fill(offsets >= lengths[:, None, None], 0.0)

"""The ``flex`` attention backend: every attention through FlexAttention with a BlockMask.

Dense blocks (:func:`flex_attention_dense`, the backend's entry in ``attention.BACKENDS``:
a staged piece, a chunk's own keys) and, where K/V lie in pages, attention over the pages in
place through a block mask of physical pages built from the block tables
(:func:`flex_paged_prefill` with :func:`chunk_block_mask`: a prefill chunk's queries over
its sequence's pages; :func:`flex_paged_decode` with :func:`decode_block_mask`: a decode
step of a batch, storing each new token first). This is
"paged attention meets FlexAttention": no page is gathered into a dense copy. Compiled on a
GPU (one compile per shape); on the CPU FlexAttention's eager path runs, for tests.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from headspace.attention.paged import Q_BLOCK, flex_paged_attention
from headspace.kv.paged_store import new_token_slots
from headspace.kv.spec import padded_length


@functools.lru_cache(maxsize=64)  # a few shapes a run: chunks, pieces, steps
def _dense_mask(num_q: int, num_kv: int, padded_kv: int, causal: bool, device: str) -> BlockMask:
    """A BlockMask of ``num_q`` queries over the first ``num_kv`` of ``padded_kv`` keys:
    every pair, or causal aligned to the keys' end (query ``i`` sees keys ``j <= i + num_kv
    - num_q``). The lengths are captured as tensors: one compiled kernel serves every
    length of a bucket."""
    num_kv_t = torch.tensor(num_kv, device=device)
    offset_t = torch.tensor(num_kv - num_q, device=device)

    def causal_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset_t  # (below num_kv: q_idx < num_q)

    def full_mod(b, h, q_idx, kv_idx):
        return kv_idx < num_kv_t

    return create_block_mask(causal_mod if causal else full_mod, None, None, num_q, padded_kv,
                             device=device)  # fmt: skip


def flex_attention_dense(
    q: torch.Tensor,  # [heads, q_tokens, dim]
    k: torch.Tensor,  # [kv_heads, kv_tokens, dim]
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    padded: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention over contiguous K/V: ``out [heads, q_tokens, dim]`` (q's dtype) and fp32
    ``lse [heads, q_tokens]`` (natural log). ``padded``: K/V padded to a power of two
    (:func:`padded_length`), the padded keys masked and their blocks skipped, so that one
    compile serves the staged prefix pieces of every length up to it (default: on a GPU,
    where not ``causal``; a causal block is a chunk's own keys, of the chunk's length)."""
    num_kv = k.shape[1]
    if padded is None:
        padded = q.is_cuda and not causal
    padded_kv = padded_length(num_kv) if padded else num_kv
    if padded_kv > num_kv:  # [kv_heads, padded, dim]
        k, v = (torch.nn.functional.pad(t, (0, 0, 0, padded_kv - num_kv)) for t in (k, v))
    mask = _dense_mask(q.shape[1], num_kv, padded_kv, causal, str(q.device))
    out, lse = flex_paged_attention(q[None], k, v, mask, scale=scale)
    return out[0], lse[0].float()


def chunk_block_mask(
    pages: torch.Tensor,  # [pages] int, one sequence's pages in logical order
    start: int,  # the chunk's first position
    num_queries: int,  # the chunk's tokens
    num_slots: int,  # pages in the pool times page size
    page_size: int,
) -> BlockMask:
    """The BlockMask of a prefill chunk's causal attention over its sequence's pages (the
    prefix and itself), built from block indices directly (no dense mask is evaluated:
    cheap at any length, and the same for every layer of the chunk). Query block ``i``
    (positions ``start + 128 i ..``) takes every page before its first position as full and
    the pages up to its last position as masked by position."""
    device = pages.device
    num_q_blocks, num_pages = -(-num_queries // Q_BLOCK), num_slots // page_size
    first = start + torch.arange(num_q_blocks, device=device) * Q_BLOCK  # [q blocks]
    last = torch.clamp(first + Q_BLOCK, max=start + num_queries) - 1
    num_full = (first + 1) // page_size  # pages wholly before the block's first query
    num_partial = last // page_size + 1 - num_full
    used = -(-(start + num_queries) // page_size)
    padded = torch.zeros(num_pages, dtype=torch.int32, device=device)
    padded[:used] = pages[:used].to(torch.int32)
    columns = torch.arange(num_pages, device=device)
    # [1, 1, q blocks, pages]; contiguous: the compiled kernel reads the indices by rows of
    # the pool's page count, whatever their strides (an expanded view reads past its end)
    full_indices = padded.expand(num_q_blocks, -1)[None, None].contiguous()
    shifted = (num_full[:, None] + columns).clamp(max=num_pages - 1)
    indices = padded[shifted][None, None]
    logical_page = torch.full((num_pages,), -1, dtype=torch.long, device=device)
    logical_page[pages[:used].long()] = torch.arange(used, device=device)
    start_t = torch.tensor(start, device=device)  # a tensor: no recompile per chunk

    def causal_pages(b, h, q_idx, slot):  # exact everywhere; blocks only skip work
        page = logical_page[slot // page_size]
        return (page >= 0) & (page * page_size + slot % page_size <= start_t + q_idx)

    def counts(n: torch.Tensor) -> torch.Tensor:
        return n.to(torch.int32)[None, None]  # [1, 1, q blocks]

    return BlockMask.from_kv_blocks(
        counts(num_partial), indices, counts(num_full), full_indices,
        BLOCK_SIZE=(Q_BLOCK, page_size), mask_mod=causal_pages,
        seq_lengths=(num_queries, num_slots),
    )  # fmt: skip


def flex_paged_prefill(
    q: torch.Tensor,  # [heads, tokens, dim]: a chunk's queries
    k: torch.Tensor,  # [kv_heads, slots, dim]: the pool, the chunk's own K/V already stored
    v: torch.Tensor,
    block_mask: BlockMask,  # :func:`chunk_block_mask` of the chunk
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk's causal attention over its sequence's pages (the prefix and itself):
    ``out [heads, tokens, dim]`` and ``lse [heads, tokens]``."""
    out, lse = flex_paged_attention(q[None], k, v, block_mask)
    return out[0], lse[0].float()


def decode_block_mask(block_tables: torch.Tensor, lengths: torch.Tensor, num_slots: int,
                      page_size: int, *, listed_only: bool | None = None) -> BlockMask:  # fmt: skip
    """The BlockMask of a decode step: one query per sequence over its ``lengths`` keys in
    the pages of ``block_tables [seqs, width]`` (no wider than the ``num_slots`` pool's
    pages), the same for every layer whose pages these tables address. Built from block
    indices on the device, with no host sync.

    Every page a sequence uses is a masked block, none a full one: FlexAttention's decode
    kernel splits a sequence's work by its blocks only when there are no full blocks (with
    full blocks it splits the whole pool's length, idling most of the GPU). The mask is
    then cheap where the kernel evaluates it, in the listed pages (``listed_only``, the
    default on a GPU: every page but the sequence's last is wholly visible, the last up to
    the length), and exact at every slot otherwise (the eager kernel, on the CPU,
    evaluates it everywhere)."""
    device = block_tables.device
    lengths = lengths.to(device).long()
    num_pages = num_slots // page_size
    tables = block_tables[:, :num_pages].long()  # [seqs, width]
    num_seqs, width = tables.shape
    num_used = (lengths + page_size - 1) // page_size  # [seqs]
    columns = torch.arange(width, device=device)
    used = columns[None] < num_used[:, None]  # [seqs, width]
    wide = torch.zeros(num_seqs, num_pages, dtype=torch.long, device=device)
    wide[:, :width] = torch.where(used, tables, 0)
    last_page = wide.gather(1, (num_used - 1).clamp(min=0)[:, None])[:, 0]  # [seqs]
    in_last = lengths - (num_used - 1).clamp(min=0) * page_size  # keys in the last page
    if listed_only is None:  # the compiled kernel, unless dynamo is off (the eager one)
        listed_only = device.type == "cuda" and not torch._dynamo.config.disable
    if listed_only:

        def visible(b, h, q_idx, slot):
            return (slot // page_size != last_page[b]) | (slot % page_size < in_last[b])

    else:
        # each page's logical index, -1 where unused (a column past the pool takes those)
        logical = torch.full((num_seqs, num_pages + 1), -1, dtype=torch.long, device=device)
        logical.scatter_(1, torch.where(used, tables, num_pages), columns.expand_as(tables))
        logical[:, num_pages] = -1

        def visible(b, h, q_idx, slot):
            page = logical[b, slot // page_size]
            return (page >= 0) & (page * page_size + slot % page_size < lengths[b])

    return BlockMask.from_kv_blocks(
        num_used.to(torch.int32).reshape(num_seqs, 1, 1),
        wide.to(torch.int32).reshape(num_seqs, 1, 1, num_pages),  # [seqs, 1, 1, pages]
        BLOCK_SIZE=(Q_BLOCK, page_size), mask_mod=visible, seq_lengths=(1, num_slots),
    )  # fmt: skip


def flex_paged_decode(
    q: torch.Tensor,  # [seqs, heads, dim]: one query token per sequence
    k: torch.Tensor,  # [kv_heads, slots, dim]: pages (a pool or a staging slot)
    v: torch.Tensor,
    block_tables: torch.Tensor,  # [seqs, max_pages] int: pages in logical order
    lengths: torch.Tensor,  # [seqs] keys per sequence (the new token included)
    page_size: int,
    *,
    new_kv: torch.Tensor | None = None,  # [2, seqs, kv_heads, dim], stored at length - 1
    new_index: torch.Tensor | None = None,  # [seqs]: where new_kv goes instead (a ring's)
    out: torch.Tensor | None = None,
    block_mask: BlockMask | None = None,  # :func:`decode_block_mask` of these tables, if built
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``flex`` twin of ``paged_decode_attention``: stores ``new_kv``, then attends
    each sequence's ``lengths`` keys through its pages: ``out [seqs, heads, dim]`` (into
    ``out`` when given) and fp32 ``lse [seqs, heads]`` (a sequence with no key: out 0, lse
    -inf)."""
    lengths = lengths.to(q.device).long()
    tables = block_tables.to(q.device)[:, : k.shape[1] // page_size]  # no wider than the pages
    if new_kv is not None:  # a sequence of length 0 stores nothing
        rows = torch.nonzero(lengths > 0)[:, 0]
        index = lengths - 1 if new_index is None else new_index.to(q.device)
        slots = new_token_slots(tables[rows], index[rows], page_size)
        k[:, slots], v[:, slots] = new_kv[0, rows].transpose(0, 1), new_kv[1, rows].transpose(0, 1)
    if block_mask is None:
        block_mask = decode_block_mask(tables, lengths, k.shape[1], page_size)
    result, lse = flex_paged_attention(q[:, :, None], k, v, block_mask)
    result, lse = result[:, :, 0], lse[:, :, 0].float()
    if out is not None:
        out.copy_(result)
        result = out
    return result, lse

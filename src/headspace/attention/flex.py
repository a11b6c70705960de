"""The ``flex`` attention backend: every attention through FlexAttention with a BlockMask.

Dense blocks (:func:`flex_attention_dense`, the backend's entry in ``attention.BACKENDS``:
a staged piece, a chunk's own keys) and, where K/V lie in pages, attention over the pages in
place through a block mask converted from logical to physical pages
(:func:`flex_paged_prefill`: a prefill chunk's queries over its sequence's pages;
:func:`flex_paged_decode`: a decode step of a batch, storing each new token first). This is
"paged attention meets FlexAttention": no page is gathered into a dense copy. Compiled on a
GPU (one compile per shape); on the CPU FlexAttention's eager path runs, for tests.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from headspace.attention.paged import flex_paged_attention, physical_block_mask


@functools.lru_cache(maxsize=64)  # a few shapes a run: chunks, pieces, steps
def _dense_mask(num_q: int, num_kv: int, causal: bool, device: str) -> BlockMask:
    """A BlockMask of ``num_q`` queries over ``num_kv`` keys: every pair, or causal aligned
    to the keys' end (query ``i`` sees keys ``j <= i + num_kv - num_q``)."""
    offset = num_kv - num_q

    def causal_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    def full_mod(b, h, q_idx, kv_idx):
        return kv_idx >= 0

    return create_block_mask(causal_mod if causal else full_mod, None, None, num_q, num_kv,
                             device=device)  # fmt: skip


def flex_attention_dense(
    q: torch.Tensor,  # [heads, q_tokens, dim]
    k: torch.Tensor,  # [kv_heads, kv_tokens, dim]
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention over contiguous K/V: ``out [heads, q_tokens, dim]`` (q's dtype) and fp32
    ``lse [heads, q_tokens]`` (natural log)."""
    mask = _dense_mask(q.shape[1], k.shape[1], causal, str(q.device))
    out, lse = flex_paged_attention(q[None], k, v, mask, scale=scale)
    return out[0], lse[0].float()


def flex_paged_prefill(
    q: torch.Tensor,  # [heads, tokens, dim]: a chunk's queries, positions start .. start + n - 1
    k: torch.Tensor,  # [kv_heads, slots, dim]: the pool, the chunk's own K/V already stored
    v: torch.Tensor,
    pages: torch.Tensor,  # [pages] the sequence's pages in logical order
    start: int,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk's causal attention over its sequence's pages (the prefix and itself):
    ``out [heads, tokens, dim]`` and ``lse [heads, tokens]``."""
    device, num_q = q.device, q.shape[1]
    as_one = torch.tensor([start], device=device), torch.tensor([num_q], device=device)
    mask = physical_block_mask(pages[None].int(), as_one[0], as_one[1], as_one[0] + num_q,
                               num_q, k.shape[1], page_size)  # fmt: skip
    out, lse = flex_paged_attention(q[None], k, v, mask)
    return out[0], lse[0].float()


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``flex`` twin of ``paged_decode_attention``: stores ``new_kv``, then attends
    each sequence's ``lengths`` keys through its pages: ``out [seqs, heads, dim]`` (into
    ``out`` when given) and fp32 ``lse [seqs, heads]`` (a sequence with no key: out 0, lse
    -inf)."""
    lengths = lengths.to(q.device).long()
    tables = block_tables.to(q.device)[:, : k.shape[1] // page_size]  # no wider than the pages
    if new_kv is not None:  # a sequence of length 0 stores nothing
        rows = torch.nonzero(lengths > 0)[:, 0]
        index = lengths - 1 if new_index is None else new_index.to(q.device).long()
        position = index[rows]
        slots = tables[rows, position // page_size].long() * page_size + position % page_size
        k[:, slots], v[:, slots] = new_kv[0, rows].transpose(0, 1), new_kv[1, rows].transpose(0, 1)
    ones = torch.ones_like(lengths)
    mask = physical_block_mask(tables.int(), lengths - 1, ones, lengths, 1, k.shape[1],
                               page_size)  # fmt: skip
    result, lse = flex_paged_attention(q[:, :, None], k, v, mask)
    result, lse = result[:, :, 0], lse[:, :, 0].float()
    if out is not None:
        out.copy_(result)
        result = out
    return result, lse

"""Decode attention over per-entry pages: every (sequence, kv head) is a row with its own
block table and length, so heads under a KV budget attend only the tokens they keep.

The rows are the paged decode kernels' sequences with one kv head each: ``q [seqs, heads,
dim]`` is viewed ``[seqs x kv_heads, group, dim]`` and the pages are one plane ``[slots,
dim]`` shared by every entry (the Triton split-K kernel on the GPU, the CPU kernel on the
CPU; both read only the row's pages).
"""

from __future__ import annotations

import torch

from headspace.attention.cpu_decode import cpu_paged_decode, cpu_paged_decode_reference
from headspace.kv.paged_store import new_token_slots


def entry_rows(q: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``q [seqs, heads, dim]`` as ``[rows, group, dim]`` rows, one per (sequence, kv head)."""
    num_seqs, num_heads, dim = q.shape
    return q.reshape(num_rows, num_heads * num_seqs // num_rows, dim)


def share_cut(fraction: torch.Tensor, lengths: torch.Tensor, page_size: int) -> torch.Tensor:
    """Where cumulative share ``fraction`` (float64, per row or one) of each row's
    ``lengths`` keys ends: whole pages, rounded half up, the row's end from 1.0 on (int64;
    :func:`~headspace.parallel.placement.copy_keys` on the host, the decode kernel on the
    GPU: the same float64 arithmetic)."""
    lengths = lengths.long()
    pages = torch.floor(fraction * lengths.double() / page_size + 0.5).long()
    return torch.where(fraction >= 1.0, lengths, torch.minimum(lengths, pages * page_size))


def share_ranges(tables: torch.Tensor, lengths: torch.Tensor, key_shares: torch.Tensor,
                 page_size: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The rows ``tables [rows, width]`` shifted to start at the page of each row's first key
    under ``key_shares [period, 2]`` (row ``r`` takes ``key_shares[r % period]``), and each
    row's number of keys from there ``[rows]`` (both int32): what the decode kernel finds
    from the shares itself, as plain rows (the CPU twin)."""
    rows = torch.arange(tables.shape[0], device=tables.device) % key_shares.shape[0]
    before, through = key_shares.to(tables.device)[rows].unbind(-1)
    first, last = share_cut(before, lengths, page_size), share_cut(through, lengths, page_size)
    width = tables.shape[-1]
    columns = torch.arange(width, device=tables.device) + (first // page_size)[:, None]
    return tables.gather(1, columns.clamp(max=width - 1)).int(), (last - first).int()


def entry_decode(
    q: torch.Tensor,  # [seqs, heads, dim]
    k: torch.Tensor,  # [slots, dim]: the entry plane's keys
    v: torch.Tensor,  # [slots, dim]
    tables: torch.Tensor,  # [seqs * kv_heads, width] int32: each row's pages (no column
    # from ceil(length / page_size) on is read)
    lengths: torch.Tensor,  # [seqs * kv_heads] int32: tokens of each row (new one included)
    page_size: int,
    *,
    new_kv: torch.Tensor | None = None,  # [2, seqs, kv_heads, dim]: the step's new token
    new_index: torch.Tensor | None = None,  # [seqs * kv_heads]: where it goes (length - 1)
    reference: bool = False,
    flex: bool = False,
    key_shares: torch.Tensor | None = None,  # [period, 2] float64: rows' share bounds
    sliced_rows: int | None = None,  # the rows the kernel sizes its key slices for
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token per sequence against each (sequence, kv head) row's own tokens,
    ``new_kv`` stored first at ``new_index`` (a ring row's slot of its oldest window token;
    default the row's last). Returns ``out [seqs, heads, dim]`` (q's dtype) and fp32 ``lse
    [seqs, heads]``; a row with no token gives out 0 and lse -inf. ``reference`` runs the
    CPU twin, ``flex`` FlexAttention over the pages (the ``flex`` backend). With
    ``key_shares`` row ``r`` attends only its keys between cumulative shares
    ``key_shares[r % period]`` (a copy's part of a head shared with other ranks; ``(0, 1)``
    every key), found inside the Triton kernel on the GPU (:func:`share_ranges` elsewhere);
    the new token is stored either way."""
    num_seqs, num_heads, dim = q.shape
    num_rows = tables.shape[0]
    tables, lengths = tables.contiguous(), lengths.contiguous()  # rows sliced from others
    rows_new = None if new_kv is None else new_kv.reshape(2, num_rows, 1, dim)
    q_rows = entry_rows(q, num_rows).contiguous()
    in_kernel = q.is_cuda and not reference and not flex
    if key_shares is not None and not in_kernel:  # store, then attend the rows' ranges
        if rows_new is not None:
            _store_new(k, v, tables, lengths, rows_new, new_index, page_size)
            rows_new = new_index = None
        tables, lengths = share_ranges(tables, lengths, key_shares, page_size)
    if flex:
        from headspace.attention.flex import flex_paged_decode

        out, lse = flex_paged_decode(q_rows, k[None], v[None], tables, lengths, page_size,
                                     new_kv=rows_new, new_index=new_index)  # fmt: skip
    elif q.is_cuda and not reference:  # the kernel stores the new token (not in empty rows)
        from headspace.attention.triton_decode import paged_decode_attention

        out, lse = paged_decode_attention(q_rows, k[None], v[None], tables, lengths, page_size,
                                          new_kv=rows_new, new_index=new_index,
                                          key_shares=key_shares,
                                          sliced_rows=sliced_rows)  # fmt: skip
    else:
        if rows_new is not None:
            _store_new(k, v, tables, lengths, rows_new, new_index, page_size)
        decode = cpu_paged_decode_reference if reference else cpu_paged_decode
        out, lse = decode(q_rows, k[None], v[None], tables, lengths.int(), page_size)
    return out.reshape(num_seqs, num_heads, dim).to(q.dtype), lse.reshape(num_seqs, num_heads)


def _store_new(k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
               rows_new: torch.Tensor, new_index: torch.Tensor | None,
               page_size: int) -> None:  # fmt: skip
    """Each row's new token ``rows_new [2, rows, 1, dim]`` into the plane at ``new_index``
    (default its last key), not in empty rows."""
    index = lengths - 1 if new_index is None else new_index
    held = lengths > 0
    slots = new_token_slots(tables, index, page_size)[held]
    k[slots], v[slots] = rows_new[0, held, 0], rows_new[1, held, 0]


__all__ = ["entry_decode", "entry_rows", "share_cut", "share_ranges"]

"""Attention patterns per head (FlexAttn, MInference, DuoAttention): which keys each query of
a head attends during prefill.

- ``full``: every earlier key (causal).
- ``streaming(sink, window)`` (A-shape): the first ``sink`` keys and the ``window`` most
  recent ones.
- ``vertical_slash(v, s)``: the ``ceil(v / 128)`` key blocks and ``ceil(s / 128)`` block
  diagonals (query block minus key block) with the most attention weight from the chunk's
  last queries, per head and chunk (MInference's estimate in the block form FlexPrefill
  runs), each computed whole, so a block mask skips every other block.
- ``block_sparse(k)``: ``k`` key blocks of 128 tokens per query block, chosen per head and
  chunk from block-averaged queries and keys, with the first block and the diagonal.

A :class:`Pattern` is the head map's spec; :func:`estimate` turns the specs of a layer's
heads into :class:`HeadPatterns`, lookup tables for one chunk (a mask function indexes them,
and ``sparse_prefill.py`` builds FlexAttention block masks from them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headspace.kv.spec import (  # the patterns' spec, pure: the planner reads it too
    BLOCK,
    FORCED_LOCAL,
    FORCED_SINK,
    KIND_IDS,
    LAST_QUERIES,
    Pattern,
    padded_length,
)
from headspace.kv.transfer import device_ints


@dataclass
class HeadPatterns:
    """A layer's query heads' patterns for one chunk of ``num_queries`` queries at positions
    ``q_start ..`` over ``num_keys`` keys (positions ``0 ..``), as lookup tables. The key
    tables span ``capacity >= num_keys`` columns (a few bucket sizes: a compiled kernel then
    serves many chunks); ``bounds`` holds ``(q_start, num_keys)`` as a tensor for the same
    reason."""

    q_start: int
    num_queries: int
    num_keys: int
    capacity: int  # key columns the tables and the kernel's keys span
    kinds: tuple[str, ...]  # each head's kind, on the host (read without a device sync)
    kind: torch.Tensor  # [heads] int: KIND_IDS
    sink: torch.Tensor  # [heads] int (streaming)
    window: torch.Tensor  # [heads] int (streaming)
    # 0/1 int32 (compiled FlexAttention kernels index int tables):
    vertical: torch.Tensor  # [heads, capacity blocks]: key blocks kept (vertical_slash)
    slash: torch.Tensor  # [heads, capacity blocks]: block diagonals kept, by query block
    # (of the query's position) minus key block (vertical_slash)
    blocks: torch.Tensor  # [heads, padded query blocks, capacity blocks] (block_sparse)
    bounds: torch.Tensor  # [2] int: q_start, num_keys

    def mask_mod(self, b, h, q_idx, kv_idx):
        """FlexAttention's mask function: query ``q_idx`` of the chunk, key ``kv_idx``; any
        mix of kinds."""
        q_pos = q_idx + self.bounds[0]
        kind = self.kind[h]
        allowed = kind == KIND_IDS["full"]
        for name, (condition, _) in SPARSE_MASKS.items():  # out of place: compiled kernels
            met = getattr(self, condition)(h, q_idx, q_pos, kv_idx)
            allowed = allowed | ((kind == KIND_IDS[name]) & met)
        return self._causal(q_pos, kv_idx) & allowed

    # :meth:`mask_mod` for a table whose sparse heads are all of one kind (reads only that
    # kind's tables; one compiled kernel each)
    def streaming_mask_mod(self, b, h, q_idx, kv_idx):
        return self._full_or(self._streaming, h, q_idx, kv_idx)

    def lines_mask_mod(self, b, h, q_idx, kv_idx):
        return self._full_or(self._lines, h, q_idx, kv_idx)

    def blocks_mask_mod(self, b, h, q_idx, kv_idx):
        return self._full_or(self._blocks, h, q_idx, kv_idx)

    @property
    def mask(self):
        """The mask function for the kinds this table holds: with one sparse kind, the one
        that evaluates only its condition (a compiled kernel evaluates the mask at every
        element of a partial block; the general one reads every kind's tables there, 3.5x
        the kernel time of the streaming one for streaming heads at 128K)."""
        sparse = set(self.kinds) - {"full"}
        if len(sparse) != 1:
            return self.mask_mod
        return getattr(self, SPARSE_MASKS[sparse.pop()][1])

    def _full_or(self, condition, h, q_idx, kv_idx):
        q_pos = q_idx + self.bounds[0]
        allowed = (self.kind[h] == KIND_IDS["full"]) | condition(h, q_idx, q_pos, kv_idx)
        return self._causal(q_pos, kv_idx) & allowed

    def _causal(self, q_pos, kv_idx):
        return (kv_idx <= q_pos) & (kv_idx < self.bounds[1])

    # each kind's condition (besides causality): head ``h``, query ``q_idx`` of the chunk
    # at position ``q_pos``, key ``kv_idx``
    def _streaming(self, h, q_idx, q_pos, kv_idx):
        return (kv_idx < self.sink[h]) | (q_pos - kv_idx < self.window[h])

    def _lines(self, h, q_idx, q_pos, kv_idx):
        last_block = self.vertical.shape[1] - 1
        key_block = (kv_idx // BLOCK).clamp(0, last_block)
        diagonal = (q_pos // BLOCK - key_block).clamp(0, last_block)
        return (self.vertical[h, key_block] + self.slash[h, diagonal]) > 0

    def _blocks(self, h, q_idx, q_pos, kv_idx):
        key_block = (kv_idx // BLOCK).clamp(0, self.blocks.shape[2] - 1)
        return self.blocks[h, (q_idx // BLOCK).clamp(0, self.blocks.shape[1] - 1),
                           key_block] > 0  # fmt: skip

    def dense(self) -> torch.Tensor:
        """The mask ``[heads, queries, keys]`` in full (the reference twin's)."""
        heads = torch.arange(self.kind.numel(), device=self.kind.device)[:, None, None]
        q_idx = torch.arange(self.num_queries, device=self.kind.device)[None, :, None]
        kv_idx = torch.arange(self.num_keys, device=self.kind.device)[None, None, :]
        return self.mask_mod(0, heads, q_idx, kv_idx)


# each sparse kind: the :class:`HeadPatterns` method of its condition, and its mask function
# for a table whose sparse heads are all of that kind
SPARSE_MASKS = {
    "streaming": ("_streaming", "streaming_mask_mod"),
    "vertical_slash": ("_lines", "lines_mask_mod"),
    "block_sparse": ("_blocks", "blocks_mask_mod"),
}


def estimate(
    patterns: list[Pattern],  # one per query head
    q: torch.Tensor,  # [heads, queries, dim]: the chunk's queries (rotated)
    k: torch.Tensor,  # [kv_heads, keys, dim]: every key up to the chunk's last, the chunk's too
    *,
    scale: float | None = None,
    capacity: int | None = None,
) -> HeadPatterns:
    """Each head's lookup tables for this chunk (key tables ``capacity`` wide, default the
    keys): vertical-slash and block-sparse heads are estimated from the chunk's queries, the
    heads of one kind and size together; the others read their parameters."""
    num_heads, num_q, dim = q.shape
    num_keys, device = k.shape[1], q.device
    if len(patterns) != num_heads:
        raise ValueError(f"{len(patterns)} patterns for {num_heads} query heads")
    capacity = num_keys if capacity is None else capacity
    scale = dim**-0.5 if scale is None else scale
    q_start = num_keys - num_q

    sinks, windows = ([p.params[i] if p.kind == "streaming" else 0 for p in patterns]
                      for i in (0, 1))  # fmt: skip
    kinds = [KIND_IDS[p.kind] for p in patterns]
    kind, sink, window = device_ints([kinds, sinks, windows], device)  # one copy: [3, heads]
    num_kb = -(-capacity // BLOCK)
    table = HeadPatterns(
        q_start, num_q, num_keys, capacity, tuple(p.kind for p in patterns),
        kind=kind, sink=sink, window=window,
        vertical=torch.zeros(num_heads, num_kb, dtype=torch.int32, device=device),
        slash=torch.zeros(num_heads, num_kb, dtype=torch.int32, device=device),
        blocks=torch.zeros(num_heads, padded_length(num_q) // BLOCK, num_kb,
                           dtype=torch.int32, device=device),
        bounds=device_ints([q_start, num_keys], device),
    )  # fmt: skip
    group, key_means = num_heads // k.shape[0], None
    for pattern in {p for p in patterns if p.kind in ("vertical_slash", "block_sparse")}:
        heads = [h for h, p in enumerate(patterns) if p == pattern]
        if pattern.kind == "vertical_slash":
            _vertical_slash(table, heads, q, k, group, *pattern.params, scale)
        else:
            if key_means is None:
                key_means = _block_means(k, -(-num_keys // BLOCK))  # [kv_heads, kb, dim]
            rows = device_ints(heads, device)
            keep = _block_sparse(q[rows], key_means[rows // group], q_start,
                                 *pattern.params, scale)  # fmt: skip
            table.blocks[rows, : keep.shape[1], : keep.shape[2]] = keep.int()
    return table


def _vertical_slash(table: HeadPatterns, heads: list[int], q, k, group: int,
                    num_vertical: int, num_slash: int, scale: float) -> None:  # fmt: skip
    """Set the key blocks and block diagonals most attended by the chunk's last queries in
    the rows ``heads`` of ``table`` (MInference's estimate, summed per block as FlexPrefill
    does): ``ceil(num_vertical / BLOCK)`` key blocks and ``ceil(num_slash / BLOCK)`` block
    diagonals, besides the first key block and the two nearest diagonals, always in; the
    heads of one kv head at a time (weights ``[heads, last queries, keys]``)."""
    num_q, num_keys, device = q.shape[1], k.shape[1], q.device
    num_kb = -(-num_keys // BLOCK)
    last = min(LAST_QUERIES, num_q)
    first = table.q_start + num_q - last  # the first of the last queries
    positions = torch.arange(first, first + last, device=device)
    hidden = torch.arange(num_keys, device=device)[None, :] > positions[:, None]
    num_v = min(-(-num_vertical // BLOCK) + FORCED_SINK, num_kb)
    num_s = min(-(-num_slash // BLOCK) + FORCED_LOCAL, num_kb)
    one = torch.ones((), dtype=torch.int32, device=device)
    for kv_head in sorted({h // group for h in heads}):
        part = device_ints([h for h in heads if h // group == kv_head], device)
        queries = q[part, -last:].reshape(-1, q.shape[-1])  # [part x last, dim]
        logits = (queries @ k[kv_head].T).float().view(len(part), last, num_keys) * scale
        weights = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1)
        sums = _block_sums(weights, num_kb)  # [part, last, key blocks]
        vertical = sums.sum(1)
        vertical[:, :FORCED_SINK] = float("inf")
        slash = torch.zeros_like(vertical)  # by query block minus key block
        for block in range(first // BLOCK, (first + last - 1) // BLOCK + 1):
            lo, hi = max(block * BLOCK, first) - first, min((block + 1) * BLOCK - first, last)
            slash[:, : block + 1] += sums[:, lo:hi, : block + 1].sum(1).flip(1)
        slash[:, :FORCED_LOCAL] = float("inf")
        # (a device value: a Python one is copied from pageable memory, a sync a chunk)
        table.vertical.index_put_((part[:, None], vertical.topk(num_v, dim=1).indices), one)
        table.slash.index_put_((part[:, None], slash.topk(num_s, dim=1).indices), one)


def _block_sums(x: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``x [..., tokens]`` summed per block of BLOCK tokens: ``[..., num_blocks]``."""
    num_full = x.shape[-1] // BLOCK
    sums = x[..., : num_full * BLOCK].unflatten(-1, (num_full, BLOCK)).sum(-1)
    if num_blocks > num_full:
        sums = torch.cat([sums, x[..., num_full * BLOCK :].sum(-1, keepdim=True)], -1)
    return sums


def _block_sparse(q, k_blocks, q_start: int, num_blocks: int, scale: float) -> torch.Tensor:
    """``[heads, query blocks, key blocks]`` for ``q [heads, queries, dim]`` over the block
    means of its keys ``k_blocks [heads, key blocks, dim]``: each query block's
    ``num_blocks`` key blocks with the highest score between block-averaged query and key,
    the first and diagonal ones (of its first and last query: a chunk may start inside a
    block) always, even beyond ``num_blocks``."""
    num_q, num_kb = q.shape[1], k_blocks.shape[1]
    num_qb = -(-num_q // BLOCK)
    q_blocks = _block_means(q, num_qb)  # [heads, qb, dim]
    first_q = torch.arange(num_qb, device=q.device) * BLOCK
    last_q = torch.clamp(first_q + BLOCK, max=num_q)
    reach = (q_start + last_q - 1) // BLOCK  # each query block's last visible key block
    own = (q_start + first_q) // BLOCK  # ... and its first query's own key block
    key_block = torch.arange(num_kb, device=q.device)
    visible = key_block[None, :] <= reach[:, None]  # [qb, kb]
    scores = torch.bmm(q_blocks, k_blocks.transpose(1, 2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    forced = torch.zeros(num_qb, num_kb, dtype=torch.bool, device=q.device)
    rows = torch.arange(num_qb, device=q.device)
    true = torch.ones((), dtype=torch.bool, device=q.device)  # (a device value: no sync)
    forced[:, 0] = True  # the first block, its own
    forced.index_put_((rows, own), true).index_put_((rows, reach), true)
    scores = scores.masked_fill(forced, float("inf"))
    top = scores.topk(min(num_blocks, num_kb), dim=2).indices
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(2, top, True)
    return (keep | forced) & visible


def _block_means(x: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``x [heads, tokens, dim]`` averaged per block of BLOCK tokens: fp32 ``[heads, blocks,
    dim]`` (summed in place of a padded fp32 copy: the keys may be long)."""
    num_tokens = x.shape[1]
    num_full = num_tokens // BLOCK
    sums = x[:, : num_full * BLOCK].unflatten(1, (num_full, BLOCK)).sum(2, dtype=torch.float32)
    if num_blocks > num_full:
        rest = x[:, num_full * BLOCK :].sum(1, keepdim=True, dtype=torch.float32)
        sums = torch.cat([sums, rest], 1)
    counts = torch.clamp(num_tokens - torch.arange(num_blocks, device=x.device) * BLOCK,
                         max=BLOCK)  # fmt: skip
    return sums / counts[:, None]

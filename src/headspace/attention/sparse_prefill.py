"""Prefill attention under per-head patterns: a FlexAttention BlockMask built from block
indices (no dense mask is evaluated, so it is cheap at any length), and its dense twin.

Blocks are 128 queries by 128 keys. A block where some query of a head may see some key is
computed with the pattern's mask function (``partial``); a block where every query sees every
key skips it (``full``); the rest are skipped. Which blocks a pattern touches follows from its
tables: prefix sums over a head's kept block diagonals count, for each block, those that
cross it.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from headspace.attention import attend
from headspace.attention.patterns import HeadPatterns, estimate
from headspace.attention.reference import reference_attention
from headspace.kv.spec import BLOCK, KIND_IDS, Pattern, padded_length
from headspace.kv.transfer import device_ints


def block_maps(
    table: HeadPatterns, num_padded: int | None = None, skip: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(touched, full)``, each ``[heads, query blocks, key blocks]`` bool over the table's
    capacity and ``num_padded`` queries (default: the chunk's): blocks where the mask allows
    some (query, key) pair, and blocks where it allows all of them; none in padding rows or
    in the heads where ``skip [heads]`` is set."""
    device, num_q, num_keys = table.kind.device, table.num_queries, table.capacity
    num_qb, num_kb = -(-(num_padded or num_q) // BLOCK), -(-num_keys // BLOCK)
    qb, kb = torch.arange(num_qb, device=device), torch.arange(num_kb, device=device)
    q_lo = (table.q_start + qb * BLOCK)[None, :, None]  # first and last query of a block
    q_hi = (table.q_start + torch.clamp((qb + 1) * BLOCK, max=num_q) - 1)[None, :, None]
    k_lo = (kb * BLOCK)[None, None, :]
    k_hi = (torch.clamp((kb + 1) * BLOCK, max=num_keys) - 1)[None, None, :]
    causal_touched, causal_full = k_lo <= q_hi, k_hi <= q_lo
    sink, window = table.sink[:, None, None], table.window[:, None, None]
    streaming_touched = causal_touched & ((k_lo < sink) | (k_hi > q_lo - window))
    streaming_full = causal_full & ((k_hi < sink) | (k_lo > q_hi - window))
    # vertical-slash: a kept key block, or the block diagonals its queries' blocks cross
    columns = table.vertical[:, None, :] > 0  # [heads, 1, key blocks]
    lo, hi = q_lo // BLOCK - kb[None, None, :], q_hi // BLOCK - kb[None, None, :]
    diagonals = _count(table.slash, lo.clamp(min=0), hi)  # kept diagonals from lo to hi
    lines_touched = causal_touched & (columns | (diagonals > 0))
    lines_full = causal_full & (columns | ((lo >= 0) & (diagonals == hi - lo + 1)))
    blocks = table.blocks[:, :num_qb] > 0  # [heads, query blocks, key blocks]
    blocks = torch.nn.functional.pad(blocks, (0, 0, 0, num_qb - blocks.shape[1]))
    kind = table.kind[:, None, None]
    is_kind = {name: kind == KIND_IDS[name] for name in KIND_IDS}
    touched = (is_kind["full"] & causal_touched) | (is_kind["streaming"] & streaming_touched)
    touched |= (is_kind["vertical_slash"] & lines_touched) | (is_kind["block_sparse"] & blocks
                                                             & causal_touched)  # fmt: skip
    full = (is_kind["full"] & causal_full) | (is_kind["streaming"] & streaming_full)
    full |= (is_kind["vertical_slash"] & lines_full) | (is_kind["block_sparse"] & blocks
                                                       & causal_full)  # fmt: skip
    keep = (qb < -(-num_q // BLOCK))[None, :, None]  # query blocks of the chunk
    if skip is not None:
        keep = keep & ~skip[:, None, None]
    return touched & keep, full & keep


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


def pattern_block_mask(
    table: HeadPatterns, num_padded: int | None = None, skip: torch.Tensor | None = None
) -> BlockMask:
    """The chunk's BlockMask under ``table``'s patterns (batch 1, one row per query head)
    for ``num_padded`` queries over the table's capacity; heads where ``skip`` is set see
    nothing. Forward only: the key-to-query transposition a backward pass reads is not
    built (two sorts over every block, 0.8 ms of a 128K chunk's 3.3 ms for 32 streaming
    heads)."""
    touched, full = block_maps(table, num_padded, skip)
    counts, indices = _indices(touched & ~full)
    full_counts, full_indices = _indices(full)
    return BlockMask.from_kv_blocks(
        counts, indices, full_counts, full_indices, BLOCK_SIZE=(BLOCK, BLOCK),
        mask_mod=table.mask, seq_lengths=(num_padded or table.num_queries, table.capacity),
        compute_q_blocks=False,
    )  # fmt: skip


# the pattern's table loads take shared memory beside the tiles: smaller tiles than the
# default (128 x 128, 3 stages) fit a Hopper SM's 227 KiB
KERNEL_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2, "num_warps": 4}


@functools.cache
def _compiled_flex():
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
    return torch.compile(flex_attention, dynamic=False)


def sparse_prefill_attention(
    q: torch.Tensor,  # [heads, queries, dim]: a chunk at positions num_keys - queries ..
    k: torch.Tensor,  # [kv_heads, >= num_keys, dim]: every key up to the chunk's last (padded)
    v: torch.Tensor,
    table: HeadPatterns,
    *,
    scale: float | None = None,
    backend: str = "flex",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the chunk under its heads' patterns: ``out [heads, queries, dim]`` in q's
    dtype and ``lse [heads, queries]`` fp32 (a row with no visible key: 0 and -inf).
    ``backend="reference"`` is the dense fp32 twin (the mask evaluated in full). The kv
    heads whose query heads are all ``full`` take the fused causal kernel (cuDNN on a GPU)
    over the first ``table.num_keys`` keys; the others FlexAttention on a GPU, the blocks
    they touch on a CPU."""
    num_keys = table.num_keys
    if backend == "reference":
        return reference_attention(q, k[:, :num_keys], v[:, :num_keys], scale=scale,
                                   mask=table.dense())  # fmt: skip
    group = q.shape[0] // k.shape[0]
    kv_full = [all(kind == "full" for kind in table.kinds[h * group : (h + 1) * group])
               for h in range(k.shape[0])]  # fmt: skip
    full = [kv_full[h // group] for h in range(q.shape[0])]  # on the host: no device sync
    sparse_attention = flex_pattern_attention if q.is_cuda else blockwise_pattern_attention
    if not any(full):
        return sparse_attention(q, k, v, table, scale)
    rows = device_ints([h for h, f in enumerate(full) if f], q.device)
    kv_rows = device_ints([h for h, f in enumerate(kv_full) if f], q.device)
    keys = (x[:, :num_keys].index_select(0, kv_rows) for x in (k, v))
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    full_out, full_lse = attend(q.index_select(0, rows), *keys, causal=True, scale=scale)
    out.index_copy_(0, rows, full_out)
    lse.index_copy_(0, rows, full_lse)
    if not all(full):
        skip = device_ints(full, q.device).bool()
        flex_out, flex_lse = sparse_attention(q, k, v, table, scale, skip=skip)
        sparse = device_ints([h for h, f in enumerate(full) if not f], q.device)
        out.index_copy_(0, sparse, flex_out.index_select(0, sparse))
        lse.index_copy_(0, sparse, flex_lse.index_select(0, sparse))
    return out, lse


def flex_pattern_attention(q, k, v, table: HeadPatterns, scale: float | None = None,
                           skip: torch.Tensor | None = None):  # fmt: skip
    """Every head through FlexAttention under ``table`` (compiled on a GPU), the queries
    padded to a power of two (one compiled kernel per padded length and key capacity);
    heads where ``skip [heads]`` is set compute nothing (their rows are not meaningful)."""
    num_q = q.shape[1]
    padded = padded_length(num_q)
    q4 = torch.nn.functional.pad(q, (0, 0, 0, padded - num_q))[None]
    fn = _compiled_flex() if q.is_cuda else flex_attention
    options = KERNEL_OPTIONS if q.is_cuda else None
    mask = pattern_block_mask(table, padded, skip)
    with warnings.catch_warnings():  # the CPU twin runs unfused on purpose
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        out, aux = fn(q4, k[None], v[None], block_mask=mask, scale=scale, enable_gqa=True,
                      return_aux=AuxRequest(lse=True), kernel_options=options)  # fmt: skip
    return out[0, :, :num_q], aux.lse[0, :, :num_q]


def blockwise_pattern_attention(q, k, v, table: HeadPatterns, scale: float | None = None,
                                skip: torch.Tensor | None = None):  # fmt: skip
    """What :func:`flex_pattern_attention` computes, for the CPU: each query block of each
    head attends only the key blocks its pattern touches, the mask evaluated there, in fp32
    (eager FlexAttention on a CPU evaluates every block: about 70x slower for a streaming
    head over 4K keys). Returns ``out [heads, queries, dim]``, ``lse [heads, queries]``."""
    num_heads, num_q, _ = q.shape
    group = num_heads // k.shape[0]
    touched, _ = block_maps(table, skip=skip)  # [heads, query blocks, key blocks]
    out = torch.zeros_like(q)
    lse = torch.full((num_heads, num_q), float("-inf"), device=q.device)
    offsets = torch.arange(BLOCK, device=q.device)
    for head, query_block in touched.any(-1).nonzero().tolist():
        rows = torch.arange(query_block * BLOCK, min((query_block + 1) * BLOCK, num_q))
        keys = (touched[head, query_block].nonzero() * BLOCK + offsets).flatten()
        keys = keys[keys < table.num_keys]  # [keys of the touched blocks]
        allowed = table.mask(0, head, rows[:, None], keys[None, :])  # [rows, keys]
        kv = head // group
        block_out, block_lse = reference_attention(
            q[head, rows][None], k[kv, keys][None], v[kv, keys][None], scale=scale,
            mask=allowed[None])  # fmt: skip
        out[head, rows], lse[head, rows] = block_out[0], block_lse[0]
    return out, lse


def prefill_with_patterns(
    q: torch.Tensor,  # [heads, queries, dim]: a chunk at positions num_keys - queries ..
    k: torch.Tensor,  # [kv_heads, capacity, dim]: keys 0 .. num_keys - 1, then padding
    v: torch.Tensor,
    num_keys: int,
    patterns: list[Pattern],  # one per query head
    *,
    backend: str = "sdpa",
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk's attention with each head's pattern estimated from the chunk and
    applied (the engine's backends: ``sdpa`` runs fused and FlexAttention kernels,
    ``reference`` the dense fp32 twin). Returns ``out [heads, queries, dim]``, ``lse [heads,
    queries]``."""
    table = estimate(patterns, q, k[:, :num_keys], scale=scale, capacity=k.shape[1])
    kernel = "reference" if backend == "reference" else "flex"
    return sparse_prefill_attention(q, k, v, table, scale=scale, backend=kernel)

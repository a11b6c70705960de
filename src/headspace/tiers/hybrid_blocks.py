"""Query-aware blocks for the hybrid tier's sparse mode: each step, per (sequence, kv head),
the CPU also attends the blocks of ``BLOCK`` tokens whose keys could weigh most for the
step's own query, besides the tokens the moving averages kept.

The kept tokens are chosen from the weights earlier queries gave; a token no earlier query
weighed (a needle's rare words, first wanted by the query that predicts them) is dropped
and stays dropped. Quest's bound finds it from the query itself: a block whose keys lie in a
box ``[lo, hi]`` per dimension has ``q . k <= q . c + |q| . r`` for every key in it (``c``
the box's centre, ``r`` its half-width), so the blocks with the highest bound for a query are
those that can hold its largest weights. The boxes cost ``2 dim`` floats per block (1/8 of
the block's K and V in bf16 for blocks of 16), are found once as the CPU side grows, and
the bound for all of a sequence's blocks is two matrix products per kv head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from headspace.kv.paged_store import token_slots

BLOCK = 16  # tokens per block whose keys one box bounds


def box_bytes_per_kv_byte(itemsize: int) -> float:
    """Host bytes of key boxes (fp32 centre and half-width: ``2 dim`` floats a block of
    ``BLOCK`` tokens) per byte of the CPU side's K and V, ``itemsize`` bytes an element: 1/8
    in bf16, 1/16 in fp32."""
    return 2 * 4 / (BLOCK * 2 * itemsize)


class KeyBoxes:
    """One sequence's key boxes: per layer, centre and half-width ``[kv heads, blocks, dim]``
    (fp32) of its CPU-side keys in blocks of ``BLOCK`` positions, grown block by block."""

    def __init__(self):
        self.boxes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def grow(self, layer: int, end: int, keys: Callable[[int, int], torch.Tensor]):
        """The boxes of ``layer``'s full blocks below position ``end``, those not yet boxed
        read through ``keys(start, stop)`` (the keys ``[kv heads, stop - start, dim]`` of
        positions ``start .. stop - 1``)."""
        centre, radius = self.boxes.get(layer, (None, None))
        done = 0 if centre is None else centre.shape[1]
        full = end // BLOCK
        if full > done or centre is None:  # (no full block yet: boxes of none)
            new = keys(done * BLOCK, full * BLOCK)  # [heads, tokens, dim], the cache's dtype
            new = new.reshape(new.shape[0], full - done, BLOCK, new.shape[-1])
            lo, hi = new.amin(2).float(), new.amax(2).float()  # [heads, blocks, dim]
            parts = ((hi + lo) / 2, (hi - lo) / 2)
            if centre is not None:
                parts = (torch.cat([centre, parts[0]], 1), torch.cat([radius, parts[1]], 1))
            self.boxes[layer] = parts
        return self.boxes[layer]


def block_bounds(q: torch.Tensor, centre: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """The most any key of each block can score for each kv head's queries: ``q [kv heads,
    group, dim]`` against boxes ``[kv heads, blocks, dim]`` -> ``[kv heads, blocks]`` (the
    largest over the group's query heads)."""
    q = q.float()
    # [heads, group, blocks]
    bound = q @ centre.transpose(1, 2) + q.abs() @ radius.transpose(1, 2)
    return bound.amax(1)


def query_positions(q: torch.Tensor, centre: torch.Tensor, radius: torch.Tensor, count: int,
                    end: int, whole: torch.Tensor | None = None) -> list[torch.Tensor]:  # fmt: skip
    """Per kv head, the positions (int64, ascending) of the ``count`` blocks with the
    highest bound for ``q [kv heads, group, dim]``, and of the tokens after the last full
    block up to ``end`` (no box bounds them yet). ``whole [kv heads, blocks]``: blocks
    already attended in full (every token kept), passed over."""
    num_blocks = centre.shape[1]
    tail = torch.arange(num_blocks * BLOCK, end)
    if not num_blocks or count <= 0:
        return [tail] * q.shape[0]
    bound = block_bounds(q, centre, radius)
    if whole is not None:
        bound = bound.masked_fill(whole, -torch.inf)
    top = bound.topk(min(count, num_blocks), dim=1).indices
    offsets = torch.arange(BLOCK)
    return [torch.cat([(blocks.sort().values[:, None] * BLOCK + offsets).flatten(), tail])
            for blocks in top]  # fmt: skip


def spare_columns(count: int, end: int) -> int:
    """Most positions :func:`query_positions` gives a head of ``end`` CPU-side tokens:
    ``count`` of its full blocks and the tail."""
    return min(count, end // BLOCK) * BLOCK + end % BLOCK


def not_in(positions: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``positions`` not among ``kept`` (ascending int64): a binary search each, so a step
    adds its blocks without touching the kept tokens' table."""
    if not len(kept):
        return positions
    index = torch.searchsorted(kept, positions).clamp(max=len(kept) - 1)
    return positions[kept[index] != positions]


def full_blocks(kept: list[torch.Tensor], num_blocks: int) -> torch.Tensor:
    """Per row of ``kept`` positions (one a kv head), which of the first ``num_blocks``
    blocks it keeps every token of: ``[rows, num_blocks]`` bool."""
    return torch.stack([torch.bincount(positions // BLOCK, minlength=num_blocks + 1)
                        [:num_blocks] == BLOCK for positions in kept])  # fmt: skip


def add_query_blocks(rows: list, layer: int, kv_range: tuple[int, int], slots_per_head: int,
                     page_size: int, q: torch.Tensor, host_kv: torch.Tensor, cached: tuple,
                     count: int) -> torch.Tensor:  # fmt: skip
    """Each sparse row's ``count`` query blocks (those not kept already) written after its
    kept tokens in the cached ``(tables, counts, kept positions, full blocks)`` of the hybrid
    tier's token tables (full blocks: each sequence's :func:`full_blocks`, by its first row,
    filled here as the boxes grow); returns this step's counts. ``rows``: per sequence, its
    sparse state (its CPU-side ``evicted_end`` and key ``boxes``) and its host pages;
    ``q [sequences, query heads of kv_range, dim]``; ``host_kv [kv heads, 2, slots, dim]`` the
    layer's host pages."""
    tables, counts, kept, full = cached
    lo, hi = kv_range
    group, step_counts, row = q.shape[1] // (hi - lo), counts.clone(), 0
    for j, (state, host_pages) in enumerate(rows):
        pages, end = torch.tensor(host_pages, dtype=torch.int64), state.evicted_end

        def keys(start: int, stop: int, pages=pages) -> torch.Tensor:  # whole pages, a head
            first, last = start // page_size, -(-stop // page_size)  # at a time
            k = torch.stack(
                [
                    host_kv[h, 0].unflatten(0, (-1, page_size)).index_select(0, pages[first:last])
                    for h in range(lo, hi)
                ]
            )
            return k.flatten(1, 2)[:, start - first * page_size : stop - first * page_size]

        centre, radius = state.boxes.grow(layer, end, keys)
        num_blocks = centre.shape[1]
        whole = full.get(row)
        if whole is None or whole.shape[1] != num_blocks:  # (kept is fixed until re-cached)
            whole = full[row] = full_blocks(kept[row : row + hi - lo], num_blocks)
        found = query_positions(q[j].view(hi - lo, group, -1), centre, radius, count, end,
                                whole)  # fmt: skip
        for h, positions in zip(range(lo, hi), found, strict=True):
            extra = not_in(positions, kept[row])
            first = int(counts[row])
            tables[row, first : first + len(extra)] = (
                token_slots(pages, extra, page_size) + 2 * h * slots_per_head
            )
            step_counts[row] = first + len(extra)
            row += 1
    return step_counts

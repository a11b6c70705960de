"""What one rank computes of a head map whose entries name ranks: per layer, the kv heads it
computes alone and the copies it computes of heads shared with other ranks, in the order its
sharded weights hold them (its own heads first, then its copies); and how a copy divides its
head's work. Pure arithmetic, the same on every rank.

A copied head's work is divided by its ``shares``: at prefill by the chunk's query rows
(each copy attends every key for its rows, so no merge is needed; the rows are cut where the
causal work reaches each share), at decode by the keys of each sequence (page-aligned
ranges, merged by log-sum-exp across the copies' ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from headspace.planner.head_map import HeadMap


@dataclass(frozen=True)
class Copy:
    """One rank's copy of a kv head computed on several ranks."""

    kv_head: int
    index: int  # which of the head's copies this is (its position in the entry's ranks)
    shares: tuple[float, ...]  # every copy's share of the head's work, in rank order
    slot: int  # the copy's head among the layer's copied heads, in kv-head order (the
    # column of the layer's log-sum-exp exchange)


@dataclass(frozen=True)
class RankLayout:
    """The heads rank ``rank`` of ``world`` computes, layer by layer."""

    rank: int
    world: int
    own: tuple[tuple[int, ...], ...]  # [layer] -> kv heads computed by this rank alone
    copies: tuple[tuple[Copy, ...], ...]  # [layer] -> this rank's copies of shared heads
    num_copied: tuple[int, ...]  # [layer] -> heads of the layer copied on several ranks

    @property
    def num_layers(self) -> int:
        return len(self.own)

    def heads(self, layer: int) -> list[int]:
        """The kv heads of ``layer`` in this rank's weight order: its own, then its copies."""
        return list(self.own[layer]) + [c.kv_head for c in self.copies[layer]]

    @property
    def layer_heads(self) -> list[int]:
        """``[layers]`` the kv heads this rank holds in each layer (own and copies)."""
        return [len(own) + len(copies) for own, copies in zip(self.own, self.copies, strict=True)]

    def key_shares(self, layer: int) -> list[tuple[float, float]]:
        """``[heads]`` in weight order, the cumulative shares ``(before, through)`` of each
        head's keys this rank attends at decode: ``(0, 1)`` for its own heads, a copy's
        bounds for its copies (:func:`copy_keys` cuts them at whole pages)."""
        own = [(0.0, 1.0)] * len(self.own[layer])
        return own + [cumulative_shares(c.shares, c.index) for c in self.copies[layer]]

    @property
    def most_heads(self) -> int:
        """The most kv heads this rank holds in one layer."""
        return max(self.layer_heads)


def rank_layout(head_map: HeadMap, rank: int, world: int) -> RankLayout:
    """The :class:`RankLayout` of ``rank`` for ``head_map``'s ranks and shares."""
    own, copies, num_copied = [], [], []
    for layer in range(head_map.num_layers):
        shared = [e for e in head_map.layer(layer) if len(e.rank) > 1]
        own.append(tuple(e.kv_head for e in head_map.layer(layer) if e.rank == (rank,)))
        copies.append(tuple(Copy(e.kv_head, e.rank.index(rank), e.shares, slot)
                            for slot, e in enumerate(shared) if rank in e.rank))  # fmt: skip
        num_copied.append(len(shared))
    return RankLayout(rank, world, tuple(own), tuple(copies), tuple(num_copied))


def cumulative_shares(shares: tuple[float, ...], index: int) -> tuple[float, float]:
    """The share of the work before copy ``index`` and through it (1.0 exactly at the end)."""
    before = math.fsum(shares[:index])
    return before, (1.0 if index == len(shares) - 1 else math.fsum(shares[: index + 1]))


def copy_rows(start: int, num_rows: int, shares: tuple[float, ...],
              index: int) -> tuple[int, int]:  # fmt: skip
    """Query rows ``[lo, hi)`` of a prefill chunk (rows at positions ``start ..``) that copy
    ``index`` computes: row ``t`` attends ``start + t + 1`` keys, and the rows are cut where
    that causal work reaches each copy's cumulative share. Copies' rows tile the chunk."""

    def cut(fraction: float) -> int:
        if fraction >= 1.0:
            return num_rows
        total = num_rows * start + num_rows * (num_rows + 1) / 2
        b = start + 0.5  # work of rows 0..t-1 is t * start + t (t + 1) / 2
        t = -b + math.sqrt(b * b + 2 * fraction * total)
        return min(num_rows, max(0, round(t)))

    before, through = cumulative_shares(shares, index)
    return cut(before), cut(through)


def copy_keys(length: int, shares: tuple[float, ...], index: int,
              page_size: int) -> tuple[int, int]:  # fmt: skip
    """Keys ``[lo, hi)`` of a ``length``-token sequence that copy ``index`` attends at decode:
    cut at whole pages by the cumulative shares, rounded half up (the last copy takes the
    tail, with the newest token). Copies' ranges tile ``0 .. length``. The decode kernel
    cuts on the device with the same float64 arithmetic."""

    def cut(fraction: float) -> int:
        if fraction >= 1.0:
            return length
        return min(length, math.floor(fraction * length / page_size + 0.5) * page_size)

    before, through = cumulative_shares(shares, index)
    return cut(before), cut(through)

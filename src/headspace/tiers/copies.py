"""The copies one rank computes of kv heads shared with other ranks (fair-copying).

Every copy stores its head's whole K/V, in its own pages beside the rank's own heads
(``store.kv[num_layers + layer]``), and divides the head's attention with the other copies:
at prefill each copy attends every key for its share of the chunk's query rows and leaves
the other rows zero; at decode each attends its page-aligned range of each sequence's keys,
and the copies' log-sum-exps are exchanged across ranks so that each scales its part by its
weight in the merge. Either way the all-reduce after o_proj sums the copies into the head's
exact attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from headspace.attention import attend
from headspace.attention.cpu_decode import cpu_paged_decode
from headspace.attention.entry_decode import new_token_slots
from headspace.attention.paged import gather_pages
from headspace.attention.sparse_prefill import prefill_with_patterns
from headspace.kv.paged_store import PagedKVStore
from headspace.kv.spec import Pattern
from headspace.parallel.placement import Copy, RankLayout, copy_rows, cumulative_shares
from headspace.tiers.base import (
    StepInputs,
    Tier,
    TierSite,
    chunk_slots,
    padded_positions,
)


class CopyTier(Tier):
    """Attends this rank's copies of shared heads; ``exchange(lse)`` returns every rank's
    ``lse`` stacked ``[world, ...]`` (an all-gather). A layer with a copy on any rank calls
    it at decode on every rank, with ``-inf`` where this rank holds no copy."""

    def __init__(self, store: PagedKVStore, layout: RankLayout, q_per_kv: int, backend: str,
                 patterns: list[list[Pattern]],
                 exchange: Callable[[torch.Tensor], torch.Tensor]):  # fmt: skip
        self.store, self.layout, self.q_per_kv, self.backend = store, layout, q_per_kv, backend
        self.patterns, self.exchange = patterns, exchange  # patterns: [layer][copy]
        self.page_size = store.page_size
        # layer -> (each copy's lse [seqs, q_per_kv], the copies' heads of the output)
        self._parts: dict[int, tuple[list[torch.Tensor], torch.Tensor]] = {}

    @classmethod
    def from_plan(cls, plan, site: TierSite) -> CopyTier | None:
        """This rank's copies (``site.layout``; None without torch.distributed). Built on
        every rank, copies or not: a layer copied on any rank exchanges at decode."""
        layout = site.layout
        if layout is None:
            return None
        patterns = [[Pattern.parse(plan.head_map.entry(layer, c.kv_head).pattern) for c in cs]
                    for layer, cs in enumerate(layout.copies)]  # fmt: skip
        return cls(site.store, layout, site.q_per_kv, site.backend, patterns, site.exchange)

    def _store_kv(self, layer: int) -> torch.Tensor:
        """This rank's copies of ``layer`` in the arena: ``[2, copies, slots, dim]``."""
        return self.store.kv[self.layout.num_layers + layer]  # [2, copies, slots, dim]

    def begin(self, step: StepInputs) -> None:
        """A new forward pass: the chunk's slots (prefill) or the new tokens' (decode)."""
        self.step = step
        if not step.decode:
            self.pages, self.slots = chunk_slots(self.store, step)
            self.num_keys = step.start + len(step.positions)
            return
        self.new_slots = new_token_slots(step.tables["gpu"], step.lengths - 1, self.page_size)
        self._ranges: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def submit(self, layer: int, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> None:
        """``q [tokens, heads, dim]``, ``kv [2, tokens, kv_heads, dim]`` of this rank's heads of
        the layer (its own first); each copy's result goes into its heads of ``out``."""
        copies = self.layout.copies[layer]
        if not copies:
            return
        first = len(self.layout.own[layer])
        heads = slice(first * self.q_per_kv, None)
        q_part, kv_part, out_part = q[:, heads], kv[:, :, first:], out[:, heads]
        store_kv = self._store_kv(layer)
        if self.step.decode:
            store_kv[:, :, self.new_slots] = kv_part.transpose(1, 2)  # [2, copies, seqs, dim]
            self._parts[layer] = self._decode(store_kv, copies, q_part, out_part), out_part
        else:
            store_kv.index_copy_(2, self.slots, kv_part.transpose(1, 2))
            for j, copy in enumerate(copies):
                cols = slice(j * self.q_per_kv, (j + 1) * self.q_per_kv)
                out_part[:, cols] = self._prefill(layer, j, copy, store_kv, q_part[:, cols])

    def collect(self, layer: int) -> None:
        """At decode, the layer's log-sum-exp exchange (every rank, when any copies it) and
        each copy's part scaled by its weight in the merge."""
        if self.layout.num_copied[layer] and self.step.decode:  # (no step in a graph)
            lse, out = self._parts.pop(layer, (None, None))
            merge_copies(self.layout, layer, lse, out, self.exchange,
                         len(self.step.positions), self.q_per_kv,
                         self.store.buffer.device)  # fmt: skip

    def _prefill(self, layer: int, j: int, copy: Copy, store_kv: torch.Tensor,
                 q: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Copy ``j``'s rows of the chunk, ``q [tokens, q_per_kv, dim]`` -> the same shape,
        zero outside its rows."""
        start, num_rows = self.step.start, q.shape[0]
        lo, hi = copy_rows(start, num_rows, copy.shares, copy.index)
        result = torch.zeros_like(q)
        if hi == lo:
            return result
        head_kv = store_kv[:, j : j + 1]  # [2, 1, slots, dim]
        pattern = self.patterns[layer][j]
        if not pattern.is_full:  # every row, then keep its own
            slots = self.store.slots(self.pages, padded_positions(self.num_keys, q.device))
            keys = head_kv.index_select(2, slots)
            patterns = [pattern] * self.q_per_kv
            out, _ = prefill_with_patterns(q.transpose(0, 1), keys[0], keys[1], self.num_keys,
                                           patterns, backend=self.backend)  # fmt: skip
            result[lo:hi] = out.transpose(0, 1)[lo:hi]
            return result
        k, v = gather_pages(head_kv, self.pages, start + hi, self.page_size)
        out, _ = attend(q[lo:hi].transpose(0, 1), k, v, causal=True, backend=self.backend)
        result[lo:hi] = out.transpose(0, 1)
        return result

    def _decode(self, store_kv: torch.Tensor, copies: tuple[Copy, ...], q: torch.Tensor,
                out: torch.Tensor) -> list[torch.Tensor]:  # fmt: skip
        """Each copy over its key range of every sequence, into ``out``; returns each copy's
        lse ``[seqs, q_per_kv]``."""
        lses = []
        for j, copy in enumerate(copies):
            table, lengths = self._key_range(copy)
            cols = slice(j * self.q_per_kv, (j + 1) * self.q_per_kv)
            k, v = store_kv[0, j : j + 1], store_kv[1, j : j + 1]
            if q.is_cuda:
                from headspace.attention.triton_decode import paged_decode_attention

                part, lse = paged_decode_attention(q[:, cols].contiguous(), k, v, table, lengths,
                                                   self.page_size)  # fmt: skip
                empty = (lengths == 0)[:, None]  # a copy with no key of a sequence
                lse = lse.masked_fill(empty, -torch.inf)
            else:
                part, lse = cpu_paged_decode(q[:, cols], k, v, table, lengths,
                                             self.page_size)  # fmt: skip
            out[:, cols] = part.to(out.dtype)
            lses.append(lse.float())
        return lses

    def _key_range(self, copy: Copy) -> tuple[torch.Tensor, torch.Tensor]:
        """The block table of each sequence's pages from the copy's first key on, and the
        number of its keys: ``([seqs, width], [seqs])``, found on the device from the step's
        tables and lengths (a CUDA graph replays it)."""
        key = (copy.shares, copy.index)
        if key not in self._ranges:
            self._ranges[key] = copy_key_range(self.step.tables["gpu"], self.step.lengths, copy,
                                               self.page_size)  # fmt: skip
        return self._ranges[key]


def merge_copies(layout: RankLayout, layer: int, lses: list[torch.Tensor] | None,
                 out: torch.Tensor | None, exchange: Callable[[torch.Tensor], torch.Tensor],
                 num_seqs: int, q_per_kv: int, device: torch.device) -> None:  # fmt: skip
    """Scale this rank's decode parts of ``layer``'s copied heads by their weights in the
    merge with the other copies: ``lses`` one ``[seqs, q_per_kv]`` per copy of the rank,
    ``out [seqs, copies x q_per_kv, dim]`` their parts (both None where the rank holds no
    copy of the layer; every rank calls it where any does, for the lse all-gather)."""
    copies = layout.copies[layer]
    mine = torch.full((num_seqs, layout.num_copied[layer], q_per_kv), -torch.inf,
                      device=device)  # fmt: skip
    for j, copy in enumerate(copies):
        mine[:, copy.slot] = lses[j]
    total = torch.logsumexp(exchange(mine), dim=0)  # [seqs, copied, q_per_kv]
    for j, copy in enumerate(copies):
        # a row no copy attends (a graph's padding) has total -inf: weight 0, not NaN
        weight = torch.exp(mine[:, copy.slot] - total[:, copy.slot]).nan_to_num(0.0)[..., None]
        cols = slice(j * q_per_kv, (j + 1) * q_per_kv)
        out[:, cols] = (out[:, cols].float().nan_to_num(0.0) * weight).to(out.dtype)


def copy_key_bounds(lengths: torch.Tensor, shares: tuple[float, ...], index: int,
                    page_size: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`~headspace.parallel.placement.copy_keys` of each of ``lengths [rows]`` on the
    device: the keys ``[lo, hi)`` copy ``index`` attends (int64, the same cuts)."""
    lengths = lengths.long()

    def cut(fraction: float) -> torch.Tensor:
        if fraction >= 1.0:
            return lengths
        pages = torch.round(fraction * lengths.double() / page_size).long()
        return torch.minimum(lengths, pages * page_size)

    before, through = cumulative_shares(shares, index)
    return cut(before), cut(through)


def copy_key_range(tables: torch.Tensor, lengths: torch.Tensor, copy: Copy,
                   page_size: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """What ``copy`` attends of each row at decode, on the device (a CUDA graph replays it):
    ``tables [rows, width]`` shifted to start at its first key's page (int32), and its number
    of keys ``[rows]`` (int32), from each row's ``lengths [rows]``."""
    lo, hi = copy_key_bounds(lengths, copy.shares, copy.index, page_size)
    width = tables.shape[-1]
    columns = torch.arange(width, device=tables.device) + (lo // page_size)[:, None]
    return tables.gather(1, columns.clamp(max=width - 1)).int(), (hi - lo).int()

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
from headspace.attention.entry_decode import share_ranges
from headspace.attention.paged import gather_pages
from headspace.attention.sparse_prefill import prefill_with_patterns
from headspace.kv.paged_store import PagedKVStore, new_token_slots
from headspace.kv.spec import Pattern
from headspace.parallel.placement import Copy, RankLayout, copy_rows
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
        device = store.buffer.device
        # [layer] -> the copies' key shares [copies, 2] (float64) and merge columns [copies]
        self.shares = key_share_tables(layout, device, copies_only=True)
        self.merge_columns = copy_columns(layout, device)
        # layer -> (the copies' lse [seqs, copies x q_per_kv], their heads of the output)
        self._parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

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
        elif not self.store.buffer.is_cuda:  # (the GPU's kernel stores the new token)
            self.new_slots = new_token_slots(step.tables["gpu"], step.lengths - 1,
                                             self.page_size)  # fmt: skip

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
            self._parts[layer] = self._decode(layer, store_kv, q_part, kv_part, out_part), out_part
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
            merge_copies(lse, out, self.merge_columns[layer], self.layout.num_copied[layer],
                         self.exchange, len(self.step.positions), self.q_per_kv,
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

    def _decode(self, layer: int, store_kv: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                out: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Every copy of ``layer`` stores the new token ``kv [2, seqs, copies, dim]`` and
        attends its key range of each sequence, into ``out``: on the GPU one launch that cuts
        the ranges itself from the lengths and shares. Returns the lse ``[seqs, copies x
        q_per_kv]``."""
        table, lengths, shares = self.step.tables["gpu"], self.step.lengths, self.shares[layer]
        if q.is_cuda:
            from headspace.attention.triton_decode import paged_decode_attention

            _, lse = paged_decode_attention(q, store_kv[0], store_kv[1], table, lengths,
                                            self.page_size, new_kv=kv, out=out,
                                            key_shares=shares)  # fmt: skip
            return lse
        store_kv[:, :, self.new_slots] = kv.transpose(1, 2)  # [2, copies, seqs, dim]
        lses = []
        for j in range(store_kv.shape[1]):
            cols = slice(j * self.q_per_kv, (j + 1) * self.q_per_kv)
            rows, counts = share_ranges(table, lengths, shares[j : j + 1], self.page_size)
            part, lse = cpu_paged_decode(q[:, cols], store_kv[0, j : j + 1],
                                         store_kv[1, j : j + 1], rows, counts,
                                         self.page_size)  # fmt: skip
            out[:, cols] = part.to(out.dtype)
            lses.append(lse.float())
        return torch.cat(lses, 1)


def merge_copies(lse: torch.Tensor | None, out: torch.Tensor | None,
                 columns: torch.Tensor | None, num_copied: int,
                 exchange: Callable[[torch.Tensor], torch.Tensor],
                 num_seqs: int, q_per_kv: int, device: torch.device) -> None:  # fmt: skip
    """Scale this rank's decode parts of a layer's copied heads by their weights in the
    merge with the other copies, in place in ``out`` (o_proj's input): ``lse [seqs, copies x
    q_per_kv]`` and ``out [seqs, copies x q_per_kv, dim]`` of the rank's copies, whose
    columns of the layer's ``num_copied`` copied heads are ``columns [copies]`` (all three
    None where the rank holds no copy of the layer; every rank calls it where any does, for
    the lse all-gather). A fixed few kernels a layer, however many copies: the lse placed,
    gathered, and the weights found and applied in one compiled kernel on the GPU."""
    mine = torch.full((num_seqs, num_copied, q_per_kv), -torch.inf, device=device)
    if lse is not None:
        lse = lse.float().view(num_seqs, -1, q_per_kv)  # [seqs, copies, q_per_kv]
        mine.index_copy_(1, columns, lse)
    every = exchange(mine)  # [world, seqs, copied, q_per_kv]
    if out is None:
        return
    parts = out.view(num_seqs, -1, q_per_kv, out.shape[-1])  # [seqs, copies, q_per_kv, dim]
    scale = _scale_by_merge_weight
    if out.is_cuda:
        global _compiled_scale
        if _compiled_scale is None:  # a graph per batch size and copy layout: more than
            # dynamo's default 8 recompiles, past which a fullgraph function raises
            config = torch._dynamo.config
            config.recompile_limit = max(config.recompile_limit, 1024)
            config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4096)
            _compiled_scale = torch.compile(_scale_by_merge_weight, fullgraph=True)
        scale = _compiled_scale
    scale(every, lse, columns, parts)


_compiled_scale = None


def _scale_by_merge_weight(every: torch.Tensor, lse: torch.Tensor, columns: torch.Tensor,
                           parts: torch.Tensor) -> None:  # fmt: skip
    """``parts [seqs, copies, q_per_kv, dim]`` times each copy's weight in its head's merge,
    ``exp(lse - logsumexp over every rank's copies)``; a row no copy attends (a graph's
    padding: every lse -inf) gets weight 0, not NaN."""
    total = torch.logsumexp(every, dim=0).index_select(1, columns)  # [seqs, copies, q_per_kv]
    weight = torch.exp(lse - total).nan_to_num(0.0)
    parts.copy_((parts.float() * weight[..., None]).nan_to_num(0.0))


def key_share_tables(layout: RankLayout, device: torch.device,
                     copies_only: bool = False) -> list[torch.Tensor]:  # fmt: skip
    """``[layer]`` the rank's heads' cumulative key shares ``[heads, 2]`` (float64, weight
    order; own heads ``(0, 1)``), or with ``copies_only`` its copies' rows alone: the
    decode kernel's ``key_shares``."""
    tables = []
    for layer in range(layout.num_layers):
        shares = layout.key_shares(layer)[len(layout.own[layer]) if copies_only else 0 :]
        tables.append(torch.tensor(shares, dtype=torch.float64, device=device).view(-1, 2))
    return tables


def copy_columns(layout: RankLayout, device: torch.device) -> list[torch.Tensor | None]:
    """``[layer]`` the columns of the layer's copied heads that this rank's copies are (int64
    ``[copies]``; None where it holds none): where :func:`merge_copies` puts their lse."""
    return [torch.tensor([c.slot for c in copies], device=device) if copies else None
            for copies in layout.copies]  # fmt: skip

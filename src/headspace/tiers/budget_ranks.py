"""One rank's KV-budget entries under torchrun: per layer its own kv heads, then its copies
of heads shared with other ranks (the order of its sharded weights), each in its own pages.

What differs from one process (:class:`~headspace.tiers.budget.BudgetTier`):

- **Which tokens each head keeps** is the same on every rank: each rank scores its heads, the
  scores are all-gathered layer by layer, and every rank lets the policy divide the budget
  over all of the layer's heads (Ada-SnapKV's heads compete across ranks) and picks its
  heads' tokens from the same scores (a copied head's from its first copy's), so every copy
  of a head keeps the same tokens.
- **A copied head** keeps its whole K/V on each copy. At prefill each copy attends only its
  share of the chunk's rows (a patterned copy every row, keeping its own); at decode every
  copy stores the new token and attends its page-aligned range of the head's kept tokens, in
  the same kernel launch as the rank's own heads (the kernel cuts each copy's range from the
  row's length and the copy's shares), and the copies merge by log-sum-exp
  (:func:`~headspace.tiers.copies.merge_copies`, scaling o_proj's input) before o_proj's
  all-reduce sums them.
"""

from __future__ import annotations

import torch

from headspace.attention.entry_decode import entry_decode
from headspace.parallel.dist import host_min
from headspace.parallel.placement import copy_rows, rank_layout
from headspace.planner.head_map import HeadMap
from headspace.tiers.base import TierSite
from headspace.tiers.budget import BudgetTier, EntryLayout, plan_entries
from headspace.tiers.copies import copy_columns, key_share_tables, merge_copies


class RankBudgetTier(BudgetTier):
    """A :class:`BudgetTier` over one rank's entries of ``head_map`` (its ``layout``);
    ``exchange(t)`` returns every rank's ``t`` stacked ``[world, ...]`` (an all-gather)."""

    def __init__(self, site: TierSite, plane: torch.Tensor, entries: EntryLayout,
                 head_map: HeadMap):  # fmt: skip
        """As a :class:`BudgetTier`, over ``site``'s rank (``layout``, ``exchange``)."""
        super().__init__(site, plane, entries)
        layout = site.layout
        self.layout, self.exchange = layout, site.exchange
        layouts = [rank_layout(head_map, r, layout.world) for r in range(layout.world)]
        self.width = max(lay.most_heads for lay in layouts)  # rows a rank sends per layer
        # [layer][kv head] -> (rank, row) of the scores every rank ranks that head's tokens by
        self.sources = [[(e.rank[0], layouts[e.rank[0]].heads(layer).index(e.kv_head))
                         for e in head_map.layer(layer)]
                        for layer in range(head_map.num_layers)]  # fmt: skip
        device = self.plane.device
        # [layer] -> each of its heads' key shares [heads, 2] (float64; own heads (0, 1)),
        # and its copies' columns among the layer's copied heads
        self.key_shares = key_share_tables(layout, device)
        self.merge_columns = copy_columns(layout, device)
        self._parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_plan(cls, plan, site: TierSite) -> RankBudgetTier:
        """This rank's entries of ``plan`` (``site.layout``)."""
        return cls(site, *plan_entries(plan, site), plan.head_map)

    def _agree(self, widest: int) -> int:
        """The widest rank's: a CUDA graph is keyed by the tables' width and captured again
        when they grow, and every rank must capture at the same step, or their collectives
        do not pair up."""
        return -host_min(-widest)

    def submit(self, layer: int, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> None:
        """``q [tokens, heads, dim]``, ``kv [2, tokens, kv_heads, dim]`` of this rank's heads
        of the layer (its own first, then its copies)."""
        if self.layer_heads[layer]:
            super().submit(layer, q, kv, out)

    def _decode(self, layer: int, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> None:
        if self.layout.copies[layer]:
            return self._decode_with_copies(layer, q, kv, out)
        super()._decode(layer, q, kv, out)

    def collect(self, layer: int):
        """At decode, the layer's log-sum-exp exchange (every rank, when any copies it)."""
        if self.step.decode and self.layout.num_copied[layer]:
            lse, out = self._parts.pop(layer, (None, None))
            merge_copies(lse, out, self.merge_columns[layer], self.layout.num_copied[layer],
                         self.exchange, len(self.step.positions), self.q_per_kv,
                         self.plane.device)  # fmt: skip
        return super().collect(layer)

    def _prefill(self, layer: int, q: torch.Tensor, kv: torch.Tensor):
        """``q [heads, tokens, dim]``: own heads over every row; each copy over its rows only
        (a full-attention copy attends the chunk's keys up to its last row; a patterned one
        every row, keeping its own), zero elsewhere. Copies stay in the plane (only own
        heads go to host pages)."""
        copies = self.layout.copies[layer]
        if not copies:
            return super()._prefill(layer, q, kv)
        staged = self._store_chunk(layer, kv)
        slots, patterns, q_per_kv = self.slots[layer], self.patterns[layer], self.q_per_kv
        num_own, num_rows = len(self.layout.own[layer]), q.shape[1]
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:2], -torch.inf, device=q.device)
        split = num_own * q_per_kv
        if num_own:
            mine = None if patterns is None else patterns[:split]
            mine = None if mine is None or all(p.is_full for p in mine) else mine
            own = self._attend_chunk(layer, q[:split], kv[:, :, :num_own], slots[:num_own],
                                     staged, mine)  # fmt: skip
            out[:split], lse[:split] = own
        for j, copy in enumerate(copies):
            h = num_own + j
            cols, heads = slice(h * q_per_kv, (h + 1) * q_per_kv), slice(h, h + 1)
            lo, hi = copy_rows(self.step.start, num_rows, copy.shares, copy.index)
            pattern = None if patterns is None else patterns[h * q_per_kv]
            if hi == lo:
                continue
            if pattern is None or pattern.is_full:
                part = self._attend_chunk(layer, q[cols, lo:hi], kv[:, :hi, heads], slots[heads],
                                          False, None)  # fmt: skip
                out[cols, lo:hi], lse[cols, lo:hi] = part
            else:  # every row under the pattern, then its own
                part = self._attend_chunk(layer, q[cols], kv[:, :, heads], slots[heads], False,
                                          [pattern] * q_per_kv)  # fmt: skip
                out[cols, lo:hi], lse[cols, lo:hi] = part[0][:, lo:hi], part[1][:, lo:hi]
        return out, lse

    def _decode_with_copies(self, layer: int, q: torch.Tensor, kv: torch.Tensor,
                            out: torch.Tensor) -> None:  # fmt: skip
        """Own rows and copies in one launch: every row stores the new token; own rows
        attend every key, each copy its range of the head's kept tokens (cut inside the
        kernel from the lengths and shares), and the copies' parts and lse wait for the
        merge."""
        num_own, newest = len(self.layout.own[layer]), self.newest
        result, lse = entry_decode(q, self.plane[0], self.plane[1], self.tables[layer],
                                   self.lengths[layer], self.page_size, new_kv=kv,
                                   new_index=None if newest is None else newest[layer],
                                   key_shares=self.key_shares[layer],
                                   sliced_rows=q.shape[0] * num_own or None)  # fmt: skip
        out.copy_(result)
        split = num_own * self.q_per_kv
        self._parts[layer] = lse[:, split:], out[:, split:]

    def _ranked_scores(self, layer: int, scores: torch.Tensor) -> torch.Tensor:
        """Every rank's scores of ``layer`` gathered: ``[kv heads of the model, prompt -
        window]`` on the device, each head's from its first copy's rank (every rank then
        ranks the same scores with the same kernels: the same kept tokens)."""
        padded = scores.new_zeros(self.width, scores.shape[-1])
        padded[: scores.shape[0]] = scores
        gathered = self.exchange(padded)  # [world, width, prompt - window]
        return torch.stack([gathered[r, i] for r, i in self.sources[layer]])

    def _heads(self) -> list[list[int]]:
        return [self.layout.heads(layer) for layer in range(self.num_layers)]

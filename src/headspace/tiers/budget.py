"""The KV-budget tier: every (layer, kv head) entry in its own pages (``kv.entry_table``).

Prefill writes each entry's pages and attends the chunk densely (the prefix gathered from
the entry plane); the prompt's last queries are kept per layer. After the prompt,
:meth:`BudgetTier.compress` scores the prompt's tokens by those queries (SnapKV's
observation window), lets the policy pick each entry's tokens, moves them to the front of
the entry's pages and gives the rest back to the pool. Decode attends each (sequence, kv
head) row over its own pages (``attention.entry_decode``), which also stores the new K/V.

Heads whose pattern is ``streaming(sink, window)`` keep, after the prompt, only its first
``sink`` tokens and last ``window`` ones, as ring entries: each new token then overwrites the
oldest window token, so such a head holds ``sink + window`` tokens however long the sequence
grows (DuoAttention's streaming heads; HeadInfer, App. D). A layer with patterns attends its
prompt chunks under each head's pattern (a streaming head sees its sink and window there
too); the others attend the prompt in full. Without a budget a streaming entry also holds
no more than its prefill ring while the prompt streams in (``kv.spec.prefill_ring``), and a
layer of ``full`` and ``streaming`` heads gathers only the keys each sees
(:meth:`BudgetTier._attend_rings`); slots are found a layer at a time
(:class:`~headspace.tiers.entry_slots.EntrySlots`), decode's tables a row per slot in use
(:class:`~headspace.tiers.entry_tables.EntryTables`).

Entries the plan puts in host pages (HeadInfer's App. D: retrieval heads offloaded, streaming
heads resident) go through :class:`~headspace.tiers.entry_staging.EntryStaging`: the same
prefill and compression over K/V gathered from both tiers, and at decode only the tokens
each keeps streamed into staging pages of the plane.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from headspace.attention import attend, merge_attention
from headspace.attention.entry_decode import entry_decode
from headspace.attention.sparse_prefill import prefill_with_patterns
from headspace.kv.spec import Pattern, padded_length, prefix_piece
from headspace.kv.transfer import device_ints
from headspace.tiers.base import (
    MIN_WIDTH,
    Tier,
    TierSite,
    bucket,
)
from headspace.tiers.budget_select import BudgetSelection
from headspace.tiers.entry_slots import EntrySlots, check_rings, ring_keys
from headspace.tiers.entry_staging import EntryStaging
from headspace.tiers.entry_tables import EntryTables
from headspace.tiers.layout import host_places, prefill_patterns

RING_KINDS = ("full", "streaming")  # patterns whose prefill gathers only what they see


@dataclass(frozen=True)
class EntryLayout:
    """Where a plan puts the entries of one runner's per-entry pages."""

    layer_heads: Sequence[int]  # [layers] entries of each layer (one rank's: its own, copies)
    rings: dict[int, tuple[int, int]] = field(default_factory=dict)  # entry -> (sink, window)
    patterns: list[list[Pattern] | None] | None = None  # [layers] per query head (None: full)
    staging: EntryStaging | None = None  # the entries in host pages (None: none)


class BudgetTier(BudgetSelection, Tier):
    """Attention of every entry over per-entry pages of one plane ``[2, slots, dim]``."""

    entry_rows = True

    def __init__(self, site: TierSite, plane: torch.Tensor, entries: EntryLayout):
        """Over ``site``'s entry pages (its ``blocks``, budget, head scores, kernels and
        slots) and ``plane`` ``[2, slots, head_dim]``, the entries ``entries`` places."""
        blocks = site.blocks
        self.plane, self.blocks, self.budget = plane, blocks, site.budget
        self.q_per_kv, self.backend = site.q_per_kv, site.backend
        layer_heads = list(entries.layer_heads)
        self.layer_heads = layer_heads  # [layers] entries of each layer
        self.first = [sum(layer_heads[:layer]) for layer in range(len(layer_heads) + 1)]
        self.num_kv_heads = layer_heads[0] if len(set(layer_heads)) == 1 else None
        self.head_scores, self.rings = site.head_scores, dict(entries.rings)
        self.staging, self.piece = entries.staging, site.prefix_piece
        self.page_size = blocks.page_size
        self.window_q: dict[int, torch.Tensor] = {}  # layer -> [tokens <= window, heads, dim]
        self._results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.num_layers = len(self.layer_heads)
        self.patterns = entries.patterns or [None] * self.num_layers
        # decode's block tables on the device, a row per token slot in use
        self.entry_tables = EntryTables(blocks.num_entries, site.max_slots, plane.device)

    @classmethod
    def from_plan(cls, plan, site: TierSite) -> BudgetTier:
        """Every entry of ``plan`` over the arena's plane (:func:`plan_entries`)."""
        return cls(site, *plan_entries(plan, site))

    def _slots(self, seq_id: int, num_positions: int) -> EntrySlots:
        """Plane slots of positions ``0 .. num_positions - 1`` in the entries of ``seq_id``,
        a layer at a time: ``[layer] -> [kv_heads, positions]``."""
        return EntrySlots(self.blocks.entries[seq_id], self.first, num_positions,
                          self.page_size, self.plane.device)  # fmt: skip

    def begin(self, step) -> None:
        self.step = step
        if not step.decode:
            (seq_id,) = step.seq_ids
            self.slots = self._slots(seq_id, step.start + len(step.positions))
            lists = self.blocks.entries[seq_id]
            if self.budget is not None and lists.wraps:  # compression scores every token
                raise RuntimeError("a KV budget's entries must hold their whole prompt")
            check_rings(lists, self.rings, len(step.positions), self.page_size)
            if self.staging is not None:  # the chunk's slots in the host pages
                self.host_pages = self.blocks.host_pages(seq_id)
                self.host_new = self.staging.host_slots(self.host_pages, step.positions)
            if step.start == 0:
                self.window_q = {}
            return
        self.begin_rows(self.step_slots, bucket(self.widest, MIN_WIDTH))
        if self.staging is not None:
            if isinstance(self.tables, torch.Tensor):  # (may view the kept tables)
                self.tables = self.tables.clone()  # offloaded rows point at staging pages
            self.staging.begin_decode(self.step_lengths, self.step_hosts, self.tables)

    @property
    def graph_version(self) -> int:
        return self.entry_tables.version

    def forget(self, seq_id: int) -> None:
        self.entry_tables.release(seq_id)

    def _agree(self, widest: int) -> int:
        """The widest row of a step's tables, as every process reads it (one: its own)."""
        return widest

    def before_decode(self, seq_ids: list[int], slots: list[int]) -> None:
        """Bring the device tables of the step's token ``slots`` up to the entries of
        ``seq_ids``: whole rows for a slot's new owner, else the pages decode added."""
        self.widest = self.entry_tables.update(self.blocks, seq_ids, slots, self._agree,
                                               newest=bool(self.rings))  # fmt: skip
        self.step_slots = device_ints(slots, self.plane.device)
        self.step_lengths = [self.blocks.entries[s].lengths for s in seq_ids]  # this step's
        self.step_hosts = [self.blocks.host_pages(s) for s in seq_ids]

    def begin_graph(self, step, views: dict[str, torch.Tensor], key: tuple) -> None:
        self.step = step
        self.begin_rows(views["slots"], key[1])

    def begin_rows(self, slots: torch.Tensor, width: int) -> None:
        """The step's tables ``[layers, seqs x kv_heads, width]`` and lengths ``[layers,
        seqs x kv_heads]``, gathered on the device for token ``slots`` (graph-safe)."""
        tables, lengths, newest = self.entry_tables.rows(slots, width)
        self.tables = self._layer_rows(tables)
        self.lengths = self._layer_rows(lengths)
        # where each row's new token goes: its last (length - 1) unless there are rings
        self.newest = self._layer_rows(newest) if self.rings else None

    def _layer_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [seqs, entries, ...]`` as ``[layers, seqs x kv_heads, ...]`` (one copy; a
        list of layers when their entries differ in number)."""
        if self.num_kv_heads is None:
            bounds = zip(self.first, self.first[1:], strict=False)
            return [rows[:, a:b].flatten(0, 1).contiguous() for a, b in bounds]
        rows = rows.view(rows.shape[0], self.num_layers, self.num_kv_heads, *rows.shape[2:])
        return rows.transpose(0, 1).flatten(1, 2).contiguous()  # (a view with one kv head)

    def submit(self, layer: int, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> None:
        """``q [tokens, heads, dim]``, ``kv [2, tokens, kv_heads, dim]`` of the whole layer."""
        if self.step.decode:
            self._staged_decode(layer, q, kv, out)
            return
        out_part, lse = self._prefill(layer, q.transpose(0, 1), kv)
        out.copy_(out_part.transpose(0, 1))
        self._results[layer] = (out, lse)
        if self.budget is None:
            return
        kept = self.window_q.get(layer)
        recent = q if kept is None else torch.cat([kept, q])
        self.window_q[layer] = recent[-self.budget.window :].clone()

    def _staged_decode(self, layer: int, q: torch.Tensor, kv: torch.Tensor,
                       out: torch.Tensor) -> None:  # fmt: skip
        """:meth:`_decode` between the layer's staged pages arriving and its offloaded rows'
        new tokens going to host pages."""
        if self.staging is not None:
            self.staging.wait(layer)
        self._decode(layer, q, kv, out)
        if self.staging is not None:
            self.staging.done(layer, kv)

    def _decode(self, layer: int, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> None:
        """``q [seqs, heads, dim]`` of one new token per sequence over each row's pages,
        ``kv [2, seqs, kv_heads, dim]`` its K/V (stored as it attends)."""
        k, v = self.plane[0], self.plane[1]
        newest = None if self.newest is None else self.newest[layer]
        result, lse = entry_decode(q, k, v, self.tables[layer], self.lengths[layer],
                                   self.page_size, new_kv=kv, new_index=newest,
                                   flex=self.backend == "flex")  # fmt: skip
        out.copy_(result)
        self._results[layer] = (out, lse.transpose(0, 1))

    def collect(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._results.pop(layer, None)

    def _prefill(self, layer: int, q: torch.Tensor, kv: torch.Tensor):
        """Store the chunk's ``kv [2, tokens, kv_heads, dim]`` in its entries and attend
        ``q [heads, tokens, dim]`` to the sequence so far: ``(out, lse)`` heads first."""
        staged = self._store_chunk(layer, kv)
        return self._attend_chunk(layer, q, kv, self.slots[layer], staged, self.patterns[layer])

    def _store_chunk(self, layer: int, kv: torch.Tensor) -> bool:
        """The chunk's ``kv [2, tokens, kv_heads, dim]`` into its entries' pages; returns
        whether some of the layer's entries are in host pages."""
        start, slots = self.step.start, self.slots[layer]  # [kv_heads, prefix + chunk]
        staged = self.staging is not None and self.staging.any(layer)
        if staged:  # the offloaded heads' K/V to host pages, the others' to the plane
            resident = self.staging.resident[layer]
            self.staging.write(layer, self.host_new, kv)
            self.plane[:, slots[resident, start:]] = kv.transpose(1, 2)[:, resident]
        else:
            self.plane[:, slots[:, start:]] = kv.transpose(1, 2)  # [2, kv_heads, tokens, dim]
        return staged

    def _attend_chunk(self, layer: int, q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor,
                      staged: bool, patterns):  # fmt: skip
        """``q [heads, rows, dim]``, the chunk's last rows up to its key ``kv [2, rows',
        kv_heads, dim]`` (``rows' >= rows``), over the prefix (``slots [kv_heads, positions]``
        of those heads) and the chunk's keys, causal at the key end; ``patterns``: one per
        query head over every key (then ``q`` and ``kv`` are the whole chunk's)."""
        if patterns is not None and all(p.kind in RING_KINDS for p in patterns):
            return self._attend_rings(layer, q, kv, slots, staged, patterns)
        if patterns is not None:  # every key, padded to a capacity: [2, kv_heads, cap, dim]
            num_keys = slots.shape[1]
            keys = self._keys(layer, slots, 0, num_keys, staged, padded_length(num_keys))
            return prefill_with_patterns(q, keys[0], keys[1], num_keys, patterns,
                                         backend=self.backend)  # fmt: skip
        return self._attend_full(layer, q, kv, slots, staged)

    def _attend_full(self, layer: int, q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor,
                     staged: bool, heads: list[int] | None = None):  # fmt: skip
        """``q [heads, rows, dim]`` over every earlier key: the chunk's ``kv`` causally,
        then the prefix in pieces, merged; with ``heads`` (kv heads of ``kv`` and
        ``slots``), only those heads' keys (``q`` holds their query heads)."""
        start, keys = self.step.start, kv.transpose(1, 2)  # [2, kv_heads, rows', dim]
        if heads is not None:
            keys = keys.index_select(1, device_ints(heads, q.device))
        out, lse = attend(q, keys[0], keys[1], causal=True, backend=self.backend)
        size = prefix_piece(q.shape[1], self.piece)  # the prefix in pieces
        for lo in range(0, start, size):  # [2, kv_heads, piece, dim]
            piece = self._keys(layer, slots, lo, min(start, lo + size), staged, heads=heads)
            earlier = attend(q, piece[0], piece[1], backend=self.backend)
            out, lse = merge_attention([out, earlier[0]], [lse, earlier[1]])
        return out, lse

    def _attend_rings(self, layer: int, q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor,
                      staged: bool, patterns: list[Pattern]):  # fmt: skip
        """The whole chunk's ``q [heads, rows, dim]`` under ``full`` and ``streaming``
        patterns, gathering no more keys than they see: the full heads over the prefix in
        pieces (:meth:`_attend_full`), each streaming head over its sink, the ``window``
        keys before the chunk and the chunk's own, renumbered as one sequence (the pattern
        then sees the keys it sees in place). A ring entry's prompt keys before those are
        overwritten by then (``kv.spec.prefill_ring``)."""
        group, device = self.q_per_kv, q.device
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=device)
        by_pattern: dict[Pattern, list[int]] = {}  # kv heads of ``kv`` and ``slots``
        for h, pattern in enumerate(patterns[::group]):
            by_pattern.setdefault(pattern, []).append(h)
        for pattern, heads in by_pattern.items():
            rows = device_ints([h * group + i for h in heads for i in range(group)], device)
            if pattern.is_full:
                part = self._attend_full(layer, q.index_select(0, rows), kv, slots, staged,
                                         heads)  # fmt: skip
            else:
                keys, num_keys = ring_keys(self.plane, kv, slots, device_ints(heads, device),
                                           self.step.start, *pattern.params)  # fmt: skip
                part = prefill_with_patterns(
                    q.index_select(0, rows),
                    keys[0],
                    keys[1],
                    num_keys,
                    [pattern] * len(rows),
                    backend=self.backend,
                )
            out.index_copy_(0, rows, part[0])
            lse.index_copy_(0, rows, part[1])
        return out, lse

    def _keys(self, layer: int, slots: torch.Tensor, lo: int, hi: int, staged: bool,
              width: int | None = None,
              heads: list[int] | None = None) -> torch.Tensor:  # fmt: skip
        """K/V ``[2, kv_heads, width, dim]`` of ``layer``'s keys ``lo .. hi - 1`` (``slots
        [kv_heads, positions]``; columns past ``hi - 1`` repeat it), from the plane and,
        when ``staged``, host pages; ``heads``: only those kv heads, in that order."""
        if staged:
            return self.staging.gather(layer, slots, lo, hi, self.host_pages, width, heads)
        columns = torch.arange(lo, lo + (width or hi - lo), device=slots.device).clamp(max=hi - 1)
        if heads is None:
            return self.plane[:, slots[:, columns]]
        rows = device_ints(heads, slots.device)[:, None]  # (the columns' slots, no more)
        return self.plane[:, slots[rows, columns[None]]]

    @torch.inference_mode()
    def after_prefill(self, seq_id: int, prompt_len: int,
                      stand_in_counts: list[list[int]] | None = None) -> list[int]:  # fmt: skip
        """Keep each entry's tokens by the budget and the rings (after the prompt of
        ``seq_id``, whose K/V and last queries this tier holds); returns the kept count
        per entry. ``stand_in_counts [layers][kv heads of the model]``: what each entry
        keeps in place of the budget's pick (its first tokens, nothing moved: a stand-in
        prompt's)."""
        if stand_in_counts is not None:
            return self._keep_counts(seq_id, prompt_len, stand_in_counts)
        slots = self._slots(seq_id, prompt_len)  # [layer] -> [kv_heads, prompt]
        self.host_pages = self.blocks.host_pages(seq_id)
        kept = self._budget_positions(slots, prompt_len)
        for e, (sink, window) in self.rings.items():
            if prompt_len > sink + window:
                kept[e] = torch.cat([torch.arange(sink),
                                     torch.arange(prompt_len - window, prompt_len)])  # fmt: skip
        offloaded = set(self.staging.entries) if self.staging is not None else set()
        for layer in self.staging.layers if self.staging is not None else ():  # in host pages
            heads = slice(self.first[layer], self.first[layer + 1])
            if all(len(kept[heads.start + h]) == prompt_len for h in self.staging.offloaded[layer]):
                continue  # every offloaded token stays where it is
            keys = self._keys(layer, slots[layer], 0, prompt_len, True)
            self.staging.compact(layer, keys, kept[heads], self.host_pages)
            del keys  # one layer's prompt K/V at a time
        moved = [e for e, p in enumerate(kept) if len(p) < prompt_len and e not in offloaded]
        if moved:  # (a ring's kept tokens may lie in its ring: gathered before any write)
            device = self.plane.device
            src = torch.cat([slots.entry(e, kept[e].to(device)) for e in moved])
            dst = torch.cat([slots.entry(e, torch.arange(len(kept[e]), device=device))
                             for e in moved])  # fmt: skip
            self.plane[:, dst] = self.plane[:, src]
        counts = [len(p) for p in kept]
        self.blocks.compress(seq_id, counts, self.rings)
        self.window_q = {}
        return counts

    def _keep_counts(self, seq_id: int, prompt_len: int, kept: list[list[int]]) -> list[int]:
        """Each entry's count of ``kept`` (by its layer and kv head) where a budget picks
        (else the whole prompt; a ring its sink and window), its first tokens left in
        place."""
        heads = self._heads() or [range(n) for n in self.layer_heads]
        picks = self._picks(prompt_len)
        counts = [min(kept[layer][h], prompt_len) if picks else prompt_len
                  for layer, hs in enumerate(heads) for h in hs]  # fmt: skip
        for e, (sink, window) in self.rings.items():
            counts[e] = min(prompt_len, sink + window)
        self.blocks.compress(seq_id, counts, self.rings)
        return counts


def plan_entries(plan, site: TierSite) -> tuple[torch.Tensor, EntryLayout]:
    """The arena's plane of entry pages ``[2, slots, head_dim]`` and where ``plan`` puts
    its entries (this rank's heads, layer by layer: its own, then its copies): the head
    map's streaming entries become rings, its offloaded ones go through
    :class:`EntryStaging` (two slots after the pool's pages)."""
    spec, head_map = site.spec, plan.head_map
    num_pages = site.store.num_bytes // spec.entry_page_bytes
    plane = site.store.buffer[: 2 * num_pages * spec.page_size * spec.head_dim]
    plane = plane.view(2, -1, spec.head_dim)
    heads = [site.heads(layer) for layer in range(spec.num_layers)]
    widths = [len(hs) for hs in heads]  # entries of each layer
    entries = [(layer, h) for layer, hs in enumerate(heads) for h in hs]  # [entry]
    offloaded = host_places(plan, heads)  # [layer] places in ``heads``
    staging = None
    if any(offloaded):
        staging = EntryStaging(plane, site.host, offloaded, widths, spec.page_size,
                               plan.num_gpu_pages, plan.entry_staging, site.counters)  # fmt: skip
    rings = {}
    for e, (layer, h) in enumerate(entries):
        pattern = Pattern.parse(head_map.entry(layer, h).pattern)
        if pattern.kind == "streaming":
            rings[e] = pattern.params
    patterns = [prefill_patterns(plan, layer, hs, site.q_per_kv)
                for layer, hs in enumerate(heads)]  # fmt: skip
    return plane, EntryLayout(widths, rings, patterns, staging)

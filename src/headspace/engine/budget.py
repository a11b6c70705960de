"""The KV-budget executor: every (layer, kv head) entry in its own pages (``kv.entry_table``).

Prefill writes each entry's pages and attends the chunk densely (the prefix gathered from
the entry plane); the prompt's last queries are kept per layer. After the prompt,
:meth:`BudgetExecutor.compress` scores the prompt's tokens by those queries (SnapKV's
observation window), lets the policy pick each entry's tokens, moves them to the front of
the entry's pages and gives the rest back to the pool. Decode attends each (sequence, kv
head) row over its own pages (``attention.entry_decode``), which also stores the new K/V.
"""

from __future__ import annotations

import torch

from headspace.attention import attend, merge_attention
from headspace.attention.entry_decode import entry_decode
from headspace.budgets import KVBudget, kept_positions, observation_scores
from headspace.engine.executors import MIN_WIDTH, bucket
from headspace.kv.entry_table import EntryBlockManager


def _table(pages: list[list[int]], width: int | None = None) -> torch.Tensor:
    """``[rows, width]`` int32 block table of page lists (padded with page 0)."""
    width = max(width or 1, max((len(p) for p in pages), default=1))
    table = torch.zeros(len(pages), width, dtype=torch.int32)
    for row, row_pages in enumerate(pages):
        table[row, : len(row_pages)] = torch.tensor(row_pages, dtype=torch.int32)
    return table


class BudgetExecutor:
    """Attention of every entry over per-entry pages of one plane ``[2, slots, dim]``."""

    def __init__(self, plane: torch.Tensor, blocks: EntryBlockManager, num_kv_heads: int,
                 q_per_kv: int, backend: str, budget: KVBudget, max_slots: int, max_pages: int,
                 head_scores: torch.Tensor | None = None):  # fmt: skip
        self.plane, self.blocks, self.budget = plane, blocks, budget
        self.num_kv_heads, self.q_per_kv, self.backend = num_kv_heads, q_per_kv, backend
        self.head_scores = head_scores
        self.page_size = blocks.page_size
        self.window_q: dict[int, torch.Tensor] = {}  # layer -> [tokens <= window, heads, dim]
        self._results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # decode reads block tables kept on the device per token slot, updated as entries
        # grow (a CUDA graph of the step gathers its rows): [slots, entries, pages]
        device, num_entries = plane.device, blocks.num_entries
        self.num_layers = num_entries // num_kv_heads
        self.entry_tables = torch.zeros(max_slots, num_entries, max_pages, dtype=torch.int32,
                                        device=device)  # fmt: skip
        self.entry_lengths = torch.zeros(max_slots, num_entries, dtype=torch.int32, device=device)
        self._owners: dict[int, tuple[object, list[int]]] = {}  # slot -> (lists, pages held)

    def _slots(self, seq_id: int, positions: torch.Tensor) -> torch.Tensor:
        """Plane slots ``[entries, tokens]`` of ``positions`` in each entry of ``seq_id``."""
        table = _table(self.blocks.entries[seq_id].pages).to(self.plane.device).long()
        pages = table[:, positions // self.page_size]
        return pages * self.page_size + positions % self.page_size

    def begin(self, step) -> None:
        self.step, device = step, self.plane.device
        if not step.decode:
            (seq_id,) = step.seq_ids
            self.seq_id = seq_id
            positions = torch.arange(step.start + len(step.positions), device=device)
            slots = self._slots(seq_id, positions)  # [entries, prefix + chunk]
            self.slots = slots.view(-1, self.num_kv_heads, slots.shape[-1])
            if step.start == 0:
                self.window_q = {}
            return
        self.begin_rows(self.step_slots, bucket(self.widest, MIN_WIDTH))

    def sync(self, seq_ids: list[int], slots: list[int]) -> None:
        """Bring the device tables of the step's token ``slots`` up to the entries of
        ``seq_ids`` (whole rows for a slot's new owner, else only the pages added)."""
        device, widest = self.plane.device, 1
        rows, columns, pages, lengths = [], [], [], []
        for seq_id, slot in zip(seq_ids, slots, strict=True):
            lists = self.blocks.entries[seq_id]
            owner, known = self._owners.get(slot, (None, []))
            if owner is not lists:  # the slot's rows belong to another sequence
                known = [0] * len(lists.pages)
            for e, entry_pages in enumerate(lists.pages):
                for i in range(known[e], len(entry_pages)):
                    rows.append(slot * len(known) + e)
                    columns.append(i)
                    pages.append(entry_pages[i])
            self._owners[slot] = (lists, [len(p) for p in lists.pages])
            widest = max(widest, max(self._owners[slot][1]))
            lengths.append(lists.lengths)
        if pages:
            flat = self.entry_tables.view(-1, self.entry_tables.shape[-1])
            index = torch.tensor([rows, columns], device=device)
            flat[index[0], index[1]] = torch.tensor(pages, dtype=torch.int32, device=device)
        slot_index = torch.tensor(slots, device=device)
        self.entry_lengths[slot_index] = torch.tensor(lengths, dtype=torch.int32, device=device)
        self.step_slots, self.widest = slot_index, widest

    def begin_rows(self, slots: torch.Tensor, width: int) -> None:
        """The step's tables ``[layers, seqs x kv_heads, width]`` and lengths ``[layers,
        seqs x kv_heads]``, gathered on the device for token ``slots`` (graph-safe)."""
        num_seqs, layers, heads = slots.shape[0], self.num_layers, self.num_kv_heads
        tables = self.entry_tables.index_select(0, slots)[:, :, :width]
        tables = tables.view(num_seqs, layers, heads, width).transpose(0, 1)
        self.tables = tables.reshape(layers, num_seqs * heads, width)
        lengths = self.entry_lengths.index_select(0, slots).view(num_seqs, layers, heads)
        self.lengths = lengths.transpose(0, 1).reshape(layers, num_seqs * heads)

    def submit(self, layer: int, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> None:
        """``q [tokens, heads, dim]``, ``kv [2, tokens, kv_heads, dim]`` of the whole layer."""
        if self.step.decode:
            k, v = self.plane[0], self.plane[1]
            result, lse = entry_decode(q, k, v, self.tables[layer], self.lengths[layer],
                                       self.page_size, new_kv=kv)  # fmt: skip
            out.copy_(result)
            self._results[layer] = (out, lse.transpose(0, 1))
            return
        start, slots = self.step.start, self.slots[layer]  # [kv_heads, prefix + chunk]
        self.plane[:, slots[:, start:]] = kv.transpose(1, 2)  # [2, kv_heads, tokens, dim]
        q_first = q.transpose(0, 1)
        out_part, lse = attend(q_first, kv[0].transpose(0, 1), kv[1].transpose(0, 1),
                               causal=True, backend=self.backend)  # fmt: skip
        if start > 0:
            prefix = self.plane[:, slots[:, :start]]  # [2, kv_heads, prefix, dim]
            earlier = attend(q_first, prefix[0], prefix[1], backend=self.backend)
            out_part, lse = merge_attention([out_part, earlier[0]], [lse, earlier[1]])
        out.copy_(out_part.transpose(0, 1))
        kept = self.window_q.get(layer)
        recent = q if kept is None else torch.cat([kept, q])
        self.window_q[layer] = recent[-self.budget.window :].clone()
        self._results[layer] = (out, lse)

    def collect(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._results.pop(layer, None)

    @torch.inference_mode()
    def compress(self, seq_id: int, prompt_len: int) -> list[int]:
        """Keep each entry's tokens by the budget (after the prompt of ``seq_id``, whose
        K/V and last queries this executor holds); returns the kept count per entry."""
        positions = torch.arange(prompt_len, device=self.plane.device)
        slots = self._slots(seq_id, positions)  # [entries, prompt]
        per_layer = slots.view(-1, self.num_kv_heads, prompt_len)
        window = min(self.budget.window, prompt_len)
        scores = []
        for layer in range(per_layer.shape[0]):
            keys = self.plane[0][per_layer[layer]]  # [kv_heads, prompt, dim]
            q_window = self.window_q[layer][-window:].transpose(0, 1)
            scores.append(observation_scores(q_window, keys).cpu())
        kept = kept_positions(self.budget, scores, prompt_len, self.head_scores)
        flat = [positions for layer in kept for positions in layer]
        src = torch.cat([row[p.to(row.device)] for row, p in zip(slots, flat, strict=True)])
        dst = torch.cat([row[: len(p)] for row, p in zip(slots, flat, strict=True)])
        self.plane[:, dst] = self.plane[:, src]
        counts = [len(p) for p in flat]
        self.blocks.compress(seq_id, counts)
        self.window_q = {}
        return counts

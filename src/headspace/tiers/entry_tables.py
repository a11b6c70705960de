"""Decode's block tables of per-entry pages, kept on the device: a row of tables ``[entries,
width]``, lengths and newest indices for each token slot in use, found through a slot-to-row
map (a CUDA graph of the step gathers its rows). Row 0 is empty (length 0) and stays so: the
graphs' padded rows and unused slots read it, and attend and write nothing.

Rows and columns are added as sequences and entries need them, so the tables take what the
running sequences hold, not every slot times the longest context (129 slots x 256 entries x
16K pages of int32 would take 2 GiB at 2M tokens). Each growth moves them to new tensors and
counts ``version``: graphs captured over the old ones are then captured again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from headspace.kv.entry_table import EntryBlockManager
from headspace.kv.transfer import device_ints
from headspace.tiers.base import MIN_WIDTH, block_table


class EntryTables:
    """``tables [rows, entries, width]`` int32 pages, ``lengths`` and ``newest [rows,
    entries]`` int32 (tokens held; where the next token goes), ``slot_row [slots]`` the row
    of each token slot (0: none)."""

    def __init__(self, num_entries: int, max_slots: int, device: torch.device):
        self.num_entries, self.device = num_entries, device
        self.slot_row = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.tables = torch.zeros(1, num_entries, MIN_WIDTH, dtype=torch.int32, device=device)
        self.lengths = torch.zeros(1, num_entries, dtype=torch.int32, device=device)
        self.newest = torch.zeros_like(self.lengths)
        self.version = 0  # growths so far
        self._row_of: dict[int, int] = {}  # token slot -> its row
        self._owners: dict[int, object] = {}  # token slot -> the EntryLists its row holds

    def update(self, blocks: EntryBlockManager, seq_ids: list[int], slots: list[int],
               agree: Callable[[int], int] | None = None) -> int:  # fmt: skip
        """Bring the rows of token ``slots`` up to the entries of ``seq_ids``: a whole row
        for a slot's new owner, else the pages decode added, and every row's lengths and
        newest indices. Returns the most pages a row of them lists (GPU or host), through
        ``agree`` when given (under torchrun the widest rank's: every rank's tables then
        grow, and its graphs are captured again, at the same step)."""
        lists = [blocks.entries[s] for s in seq_ids]
        widest = max((max(max(map(len, x.pages)), len(x.host)) for x in lists), default=1)
        widest = agree(widest) if agree is not None else widest
        self._grow([self._row(slot) for slot in slots], widest)
        added = []  # (row, entry, column, page)
        for entries, slot in zip(lists, slots, strict=True):
            row = self._row_of[slot]
            if self._owners.get(slot) is not entries:  # the slot's row was another's
                table = device_ints(block_table(entries.pages), self.device, torch.int32)
                self.tables[row, :, : table.shape[1]] = table
                self.tables[row, :, table.shape[1] :] = 0
                self._owners[slot] = entries
            else:
                added += [(row, e, i, page) for e, i, page in entries.added]
            entries.added = []
        if added:
            rows, entry, columns, pages = device_ints(added, self.device).T
            self.tables[rows, entry, columns] = pages.int()
        rows = device_ints([self._row_of[slot] for slot in slots], self.device)
        self.lengths[rows] = device_ints([x.lengths for x in lists], self.device, torch.int32)
        self.newest[rows] = device_ints([x.newest for x in lists], self.device, torch.int32)
        return widest

    def _row(self, slot: int) -> int:
        """The row of ``slot``, a new one (and the device map) for a slot first seen."""
        if slot not in self._row_of:
            self._row_of[slot] = len(self._row_of) + 1
            self.slot_row[slot] = self._row_of[slot]
        return self._row_of[slot]

    def _grow(self, rows: list[int], widest: int) -> None:
        """Tensors with room for ``rows`` and ``widest`` pages a row (rows and width doubled
        at least, so growths stay few), the old rows copied over."""
        num_rows, width = self.tables.shape[0], self.tables.shape[2]
        need_rows = max(rows, default=0) + 1
        need_rows = num_rows if need_rows <= num_rows else max(need_rows, 2 * num_rows)
        need_width = width if widest <= width else max(widest, 2 * width)
        if (need_rows, need_width) == (num_rows, width):
            return
        tables = self.tables.new_zeros(need_rows, self.num_entries, need_width)
        tables[:num_rows, :, :width] = self.tables
        lengths = self.lengths.new_zeros(need_rows, self.num_entries)
        newest = torch.zeros_like(lengths)
        lengths[:num_rows], newest[:num_rows] = self.lengths, self.newest
        self.tables, self.lengths, self.newest = tables, lengths, newest
        self.version += 1

    def rows(self, slots: torch.Tensor, width: int):
        """``(tables [seqs, entries, width], lengths, newest [seqs, entries])`` of token
        ``slots`` (a device tensor; graph-safe), ``width`` columns (zero past the rows')."""
        rows = self.slot_row[slots]
        tables = self.tables[rows, :, : min(width, self.tables.shape[2])]
        if tables.shape[2] < width:
            tables = torch.nn.functional.pad(tables, (0, width - tables.shape[2]))
        return tables, self.lengths[rows], self.newest[rows]


__all__ = ["EntryTables"]

"""Decode's block tables of per-entry pages, kept on the device: a row of tables ``[entries,
width]``, lengths and newest indices for each token slot in use, found through a slot-to-row
map (a CUDA graph of the step gathers its rows). Row 0 is empty (length 0) and stays so: the
graphs' padded rows and unused slots read it, and attend and write nothing.

Rows are taken as sequences start decoding and given back when they end (the lowest free
first), and columns are added as entries need them, so the tables take what the running
sequences hold, not every slot times the longest context (129 slots x 256 entries x 16K
pages of int32 would take 2 GiB at 2M tokens). A growth moves them to new tensors, as many
rows as are in use then, and takes a new ``version`` (never one an earlier object had):
graphs captured over the old ones are then captured again.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from headspace.kv.entry_table import EntryBlockManager
from headspace.kv.transfer import device_ints
from headspace.tiers.base import MIN_WIDTH, block_table

_VERSIONS = itertools.count(1)  # versions of every EntryTables: a rebuilt tier's are new


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
        self.version = next(_VERSIONS)  # a new one at each growth
        self._row_of: dict[int, int] = {}  # token slot -> its row
        self._owners: dict[int, object] = {}  # token slot -> the EntryLists its row holds
        self._slot_of: dict[int, int] = {}  # sequence -> its token slot

    def update(self, blocks: EntryBlockManager, seq_ids: list[int], slots: list[int],
               agree: Callable[[int], int] | None = None, newest: bool = True) -> int:  # fmt: skip
        """Bring the rows of token ``slots`` up to the entries of ``seq_ids``: a whole row
        for a slot's new owner, else the pages decode added, and every row's lengths and
        (with ``newest``, where rings read them) newest indices. Returns the most pages a
        row of them lists (GPU or host), through ``agree`` when given (under torchrun the
        widest rank's: every rank's tables then grow, and its graphs are captured again, at
        the same step)."""
        lists = [blocks.entries[s] for s in seq_ids]
        widest = max((max(max(map(len, x.pages)), len(x.host)) for x in lists), default=1)
        widest = agree(widest) if agree is not None else widest
        self._grow([self._row(slot) for slot in slots], widest)
        added = []  # (row, entry, column, page)
        for seq_id, entries, slot in zip(seq_ids, lists, slots, strict=True):
            row, self._slot_of[seq_id] = self._row_of[slot], slot
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
        if newest:  # (where each new token goes, read only where rings are)
            self.newest[rows] = device_ints([x.newest for x in lists], self.device, torch.int32)
        return widest

    @torch.inference_mode()
    def release(self, seq_id: int) -> None:
        """``seq_id`` ended: its slot reads the empty row again and its row is free."""
        slot = self._slot_of.pop(seq_id, None)
        if slot is None or slot not in self._row_of:
            return
        row = self._row_of.pop(slot)
        self._owners.pop(slot, None)
        self.slot_row[slot].fill_(0)  # (queued: assigning a number to one element waits)
        if row < self.lengths.shape[0]:
            self.lengths[row] = 0

    def _row(self, slot: int) -> int:
        """The row of ``slot``: for a slot not seen since its last sequence, the lowest free
        one (and the device map)."""
        if slot not in self._row_of:
            used = set(self._row_of.values())
            self._row_of[slot] = next(r for r in itertools.count(1) if r not in used)
            self.slot_row[slot].fill_(self._row_of[slot])  # (queued, as in release)
        return self._row_of[slot]

    def _grow(self, rows: list[int], widest: int) -> None:
        """Tensors with room for ``rows`` and ``widest`` pages a row (doubled at least, so
        growths stay few; as many rows as are in use when only the width grows), the rows
        in use copied over."""
        num_rows, width = self.tables.shape[0], self.tables.shape[2]
        top = max([*rows, *self._row_of.values()], default=0) + 1  # rows in use lie below
        more_rows, wider = top > num_rows, widest > width
        if not (more_rows or wider):
            return
        need_rows = max(top, 2 * num_rows) if more_rows else top
        need_width = max(widest, 2 * width) if wider else width
        kept = min(num_rows, need_rows)
        tables = self.tables.new_zeros(need_rows, self.num_entries, need_width)
        tables[:kept, :, :width] = self.tables[:kept]
        lengths = self.lengths.new_zeros(need_rows, self.num_entries)
        newest = torch.zeros_like(lengths)
        lengths[:kept], newest[:kept] = self.lengths[:kept], self.newest[:kept]
        self.tables, self.lengths, self.newest = tables, lengths, newest
        self.version = next(_VERSIONS)

    def rows(self, slots: torch.Tensor, width: int):
        """``(tables [seqs, entries, width], lengths, newest [seqs, entries])`` of token
        ``slots`` (a device tensor; graph-safe), ``width`` columns (zero past the rows')."""
        rows = self.slot_row[slots]
        tables = self.tables[rows, :, : min(width, self.tables.shape[2])]
        if tables.shape[2] < width:
            tables = torch.nn.functional.pad(tables, (0, width - tables.shape[2]))
        return tables, self.lengths[rows], self.newest[rows]


__all__ = ["EntryTables"]

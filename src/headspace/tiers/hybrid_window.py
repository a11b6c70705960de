"""The hybrid tier's GPU window kept in GPU pages (HGCA): the last ``gpu_window`` tokens of
each sequence's hybrid (layer, kv head) entries stay on the GPU, so a decode step sends only
the query and the CPU side's ``(out, lse)`` over PCIe (and, below a CPU share of 1, the
older part that streams).

Each sequence holds a *row*: per layer and hybrid kv head a ring of ``ring_pages`` GPU pages,
page ``j`` of its history in ring page ``j % ring_pages``. A step's GPU side starts at a page
boundary at most ``gpu_window`` tokens before the new token, so it never spans more pages
than the ring. The decode kernel appends each new token in the ring (as it does in a staging
slot) and the tier writes it to host pages as before; a page that leaves the window is
simply no longer read, its host copy already there. A sequence's ring is filled from host
pages once, at its first decode step (or whenever its length is not the one its ring was
left at: a prompt continued, a step that raised). A step whose sequences find no free row
(rows held by sequences outside the step are taken first), or whose window spans more pages
than the rings hold (a window wider than the context the plan was sized for, and a longer
request joined), has its window staged instead.
"""

from __future__ import annotations

import torch

from headspace.kv.host_store import HostKVArena
from headspace.kv.transfer import as_heads, copy_pages, device_ints
from headspace.tiers.base import MIN_WIDTH, HeadRange, block_table, bucket
from headspace.tiers.pieces import Piece


class GpuWindow:
    """Rings of GPU pages over the hybrid entries' recent tokens.

    ``pages[layer]``: ``[2, heads, rows x ring_pages x page_size, dim]`` (K, V), the layer's
    hybrid kv heads from place ``first_place[layer]`` on in its first ``heads`` rows.
    """

    def __init__(self, pages: list[torch.Tensor], first_place: list[int], num_heads: list[int],
                 ring_pages: int, window: int, host: HostKVArena):  # fmt: skip
        self.pages, self.first_place, self.num_heads = pages, first_place, num_heads
        self.ring_pages, self.window, self.host = ring_pages, window, host
        self.page_size = host.spec.page_size
        self.num_rows = pages[0].shape[2] // (ring_pages * self.page_size)
        self.device = pages[0].device
        self.row_of: dict[int, int] = {}  # sequence -> its row
        self.held: dict[int, int] = {}  # sequence -> tokens its ring holds (its length)
        self.piece: Piece | None = None  # this step's window, None when it is staged
        self._fills: tuple[torch.Tensor, torch.Tensor] | None = None  # host, ring pages

    @classmethod
    def over_groups(cls, pages: list[torch.Tensor], groups: list[list[HeadRange]],
                    ring_pages: int, window: int,
                    host: HostKVArena) -> GpuWindow | None:  # fmt: skip
        """The window over each layer's hybrid ``groups`` (adjacent kv-head ranges); None
        where a layer has more hybrid heads than the pages hold."""
        first = [g[0][0] if g else 0 for g in groups]
        heads = [g[-1][1] - g[0][0] if g else 0 for g in groups]
        if not pages or max(heads) > pages[0].shape[1]:
            return None
        return cls(pages, first, heads, ring_pages, window, host)

    def forget(self, seq_id: int) -> None:
        self.row_of.pop(seq_id, None)
        self.held.pop(seq_id, None)

    def begin(self, seq_ids: list[int], lengths: list[int], host_pages: list[list[int]],
              cpu_pages: list[int]) -> list[int] | None:  # fmt: skip
        """A decode step of ``seq_ids`` with ``lengths`` tokens before their new ones, whose
        first ``cpu_pages`` pages the CPU attends: the first page of each one's window (the
        pages between stream), or None when a sequence finds no row (the window is staged
        this step). Plans the rings' fills and builds :attr:`piece`."""
        self.piece, self._fills = None, None
        size, ring = self.page_size, self.ring_pages
        firsts = [max(cpu, max(n - self.window, 0) // size) for n, cpu in
                  zip(lengths, cpu_pages, strict=True)]  # fmt: skip
        spans = (n // size - first + 1 for n, first in zip(lengths, firsts, strict=True))
        if max(spans) > ring or not self._assign(seq_ids):  # a sequence longer than the
            for seq_id in seq_ids:  # rings were sized for, or no row: staged, and their
                self.held.pop(seq_id, None)  # rings miss this step's token
            return None
        fill_host, fill_ring, tables = [], [], []
        for seq_id, n, first, pages in zip(seq_ids, lengths, firsts, host_pages, strict=True):
            base = self.row_of[seq_id] * ring
            ring_of = [base + j % ring for j in range(first, n // size + 1)]
            if self.held.get(seq_id) != n:  # fill the pages before the new token's
                filled = range(first, -(-n // size))
                fill_host += [pages[j] for j in filled]
                fill_ring += [base + j % ring for j in filled]
            self.held[seq_id] = n + 1
            tables.append(ring_of)
        if fill_host:
            self._fills = tuple(device_ints([fill_host, fill_ring], self.device))
        self.piece = self._piece(tables, lengths, firsts)
        return firsts

    def _assign(self, seq_ids: list[int]) -> bool:
        """A row for each of ``seq_ids``, taking those of sequences outside the step where
        no row is free; False when the step has more sequences than rows."""
        if len(seq_ids) > self.num_rows:
            return False
        wanted = set(seq_ids)
        free = sorted(set(range(self.num_rows)) - set(self.row_of.values()))
        for seq_id in seq_ids:
            if seq_id in self.row_of:
                continue
            if not free:  # a sequence not in this step gives its row up
                other = next(s for s in self.row_of if s not in wanted)
                free.append(self.row_of[other])
                self.forget(other)
            self.row_of[seq_id] = free.pop(0)
        return True

    def _piece(self, tables: list[list[int]], lengths: list[int], firsts: list[int]) -> Piece:
        """The step's window as a piece: ring ``tables``, each sequence's keys from page
        ``firsts`` on, its new token included."""
        size = self.page_size
        table = block_table(tables, bucket(max(map(len, tables)), MIN_WIDTH))
        keys = [n + 1 - first * size for n, first in zip(lengths, firsts, strict=True)]
        keys_on, offsets_on = device_ints([keys, [f * size for f in firsts]], self.device)
        return Piece(torch.empty(0, dtype=torch.int32), 0, device_ints(table, self.device,
                     torch.int32), keys_on, offsets=offsets_on, width=max(keys))  # fmt: skip

    def fill(self, layer: int) -> int:
        """Copy the pages planned at :meth:`begin` from host pages into ``layer``'s rings
        (on the current stream, before the layer's attention); the entry pages copied."""
        if self._fills is None or not self.num_heads[layer]:
            return 0
        host_pages, ring_pages = self._fills
        first, heads = self.first_place[layer], self.num_heads[layer]
        places = torch.arange(first, first + heads, device=self.device)
        copy_pages(self.host.layer(layer), as_heads(self.pages[layer], kv_first=True),
                   host_pages, ring_pages, places, places - first, self.page_size)  # fmt: skip
        return host_pages.numel() * heads

    def keys(self, layer: int, kv_range: HeadRange) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[heads, slots, dim]`` of ``kv_range``'s rings in ``layer``."""
        lo, hi = (p - self.first_place[layer] for p in kv_range)
        return self.pages[layer][0, lo:hi], self.pages[layer][1, lo:hi]

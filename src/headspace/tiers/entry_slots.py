"""Plane slots of one sequence's entries during its prefill, a layer at a time.

An entry's slot of position ``p`` is ``pages[column] * page_size + p % page_size``, the
column being ``p // page_size``, or for a streaming entry whose prompt wraps its prefill
ring (``kv.entry_table.EntryLists.wraps``) ``sink + (p // page_size - sink) % ring`` past
its sink pages. Slots are found for one layer when asked and kept until another is: the
slots of every entry of a 2M-token prompt would take 4 GiB, a layer's 128 MiB.
"""

from __future__ import annotations

import torch

from headspace.kv.entry_table import EntryLists
from headspace.kv.spec import padded_length
from headspace.kv.transfer import device_ints
from headspace.tiers.base import block_table


class EntrySlots:
    """``slots[layer]``: ``[layer's entries, positions]`` int64 plane slots of positions
    ``0 .. num_positions - 1`` of each of the layer's entries (``first[layer] ..
    first[layer + 1] - 1``); an offloaded entry's row points at page 0 (it has no GPU
    pages)."""

    def __init__(self, lists: EntryLists, first: list[int], num_positions: int, page_size: int,
                 device: torch.device):  # fmt: skip
        self.first, self.num_positions, self.page_size = first, num_positions, page_size
        width = -(-num_positions // page_size)  # logical pages; a ring lists fewer
        self.table = device_ints(block_table(lists.pages, width), device, torch.int32)
        self.rings = None  # [entries] sink pages, ring pages (0: no ring)
        if lists.wraps:
            rings = [lists.wraps.get(e, (0, 0)) for e in range(len(lists.pages))]
            self.rings = device_ints(rings, device).T  # [2, entries]
        self.positions = torch.arange(num_positions, device=device)
        self._layer: tuple[int, torch.Tensor] | None = None

    def __getitem__(self, layer: int) -> torch.Tensor:
        if self._layer is None or self._layer[0] != layer:
            self._layer = None  # one layer's slots at a time
            self._layer = layer, self._find(self.first[layer], self.first[layer + 1])
        return self._layer[1]

    def _find(self, lo: int, hi: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Slots ``[hi - lo, positions]`` of entries ``lo .. hi - 1`` (default: every
        position)."""
        size = self.page_size
        positions = self.positions if positions is None else positions
        columns = (positions // size).expand(hi - lo, -1)  # [entries, positions]
        if self.rings is not None:
            sink, ring = self.rings[:, lo:hi, None]
            wrapped = (ring > 0) & (columns >= sink)
            columns = torch.where(wrapped, sink + (columns - sink) % ring.clamp(min=1), columns)
        pages = self.table[lo:hi].gather(1, columns).long()
        return pages * size + positions % size

    def entry(self, entry: int, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Slots ``[positions]`` of one entry (of any layer) at ``positions`` (default:
        every position)."""
        return self._find(entry, entry + 1, positions)[0]


def check_rings(lists: EntryLists, rings: dict[int, tuple[int, int]], num_tokens: int,
                page_size: int) -> None:  # fmt: skip
    """RuntimeError if a prefill chunk of ``num_tokens`` would overwrite keys that the
    prefill rings of ``lists``' wrapped entries (``rings``: each one's ``(sink, window)``)
    still hold for it: the rings were sized for smaller chunks."""
    for e, (_, ring) in lists.wraps.items():
        if (rings[e][1] + num_tokens) // page_size + 2 > ring:
            raise RuntimeError(f"a prefill chunk of {num_tokens} tokens is larger than entry "
                               f"{e}'s prefill ring of {ring} pages holds")  # fmt: skip


def ring_keys(plane: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor,
              start: int, sink: int, window: int) -> tuple[torch.Tensor, int]:  # fmt: skip
    """K/V ``[2, heads, capacity, dim]`` (zero past the keys) that a ``streaming(sink,
    window)`` head's chunk at ``start`` sees, as one sequence, and their number: the sink,
    the ``window`` keys before the chunk (every key before it while they reach the sink)
    and the chunk's own. ``plane [2, slots, dim]``; ``kv [2, rows, kv_heads, dim]`` the
    chunk's K/V; ``slots [kv_heads, positions]``; ``heads`` (of ``kv`` and ``slots``)
    resident ones."""
    device = kv.device
    if start - window <= sink:
        before = torch.arange(start, device=device)
    else:
        before = torch.cat([torch.arange(sink, device=device),
                            torch.arange(start - window, start, device=device)])  # fmt: skip
    num_keys = before.numel() + kv.shape[1]
    keys = plane.new_zeros(2, heads.numel(), padded_length(num_keys), kv.shape[-1])
    keys[:, :, : before.numel()] = plane[:, slots[heads[:, None], before[None]]]
    keys[:, :, before.numel() : num_keys] = kv.transpose(1, 2).index_select(1, heads)
    return keys, num_keys


__all__ = ["EntrySlots", "check_rings", "ring_keys"]

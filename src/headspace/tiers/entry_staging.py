"""Offloaded per-head-page entries: (layer, kv head) entries under a KV budget whose tokens
lie in the sequence's host pages (``kv.entry_table``), each entry's kept tokens at the front.

At prefill a chunk's K/V of these entries goes to host pages, and a layer's keys are
gathered from both tiers into one device tensor. After the prompt the kept tokens are moved
to the front of each entry's host rows. At decode each entry streams only the pages of its
own length into a staging slot of the GPU plane (two slots: the next layer's copy runs on a
copy stream while this one attends), and its rows of the step's block tables point there,
so one decode launch per layer still covers every entry; the new token is written back to
host pages. On the CPU the same code runs synchronously.
"""

from __future__ import annotations

import torch

from headspace.kv.host_store import HostKVArena
from headspace.kv.paged_store import new_token_slots, token_slots
from headspace.kv.transfer import (
    as_heads,
    copy_pages,
    device_ints,
    shared_stream,
    write_tokens,
)
from headspace.planner.entry_offload import STAGING_DEPTH
from headspace.tiers.base import COPY_PRIORITY, TierCounters, block_table


class EntryStaging:
    """The host tier of an entry plane ``[2, slots, dim]``: ``offloaded[layer]`` the places
    (in the layer's ``layer_heads`` entries, which are kv heads in one process and a rank's
    own heads then its copies under torchrun) of its entries in host pages, whose rows of
    the layer's host page are ``0, 1, ..`` in that order (the arena holds as many rows as
    the fullest layer offloads); staging slot ``i`` is ``slot_pages`` plane pages from page
    ``first_page + i * slot_pages``."""

    MIN_RUN_PAGES = 16  # consecutive host pages worth a copy-engine call (512 KiB at 128 x 128)

    def __init__(self, plane: torch.Tensor, host: HostKVArena, offloaded: list[list[int]],
                 layer_heads: list[int], page_size: int, first_page: int,
                 slot_pages: int, counters: TierCounters | None = None):  # fmt: skip
        self.plane, self.host, self.page_size = plane, host, page_size
        self.counters = counters or TierCounters()  # pages staged by each path, in total
        self.first_page, self.slot_pages = first_page, slot_pages
        self.layer_heads = layer_heads  # [layers] entries of each layer
        first = [sum(layer_heads[:layer]) for layer in range(len(layer_heads))]
        device = plane.device
        self.offloaded = offloaded
        self.layers = [layer for layer, hs in enumerate(offloaded) if hs]  # with any in host
        self.heads = [torch.tensor(h, device=device, dtype=torch.long) for h in offloaded]
        self.rows = [torch.arange(len(h), device=device) for h in offloaded]  # host rows
        self._resident = [sorted(set(range(n)) - set(h))
                          for n, h in zip(layer_heads, offloaded, strict=True)]  # fmt: skip
        self.resident = [torch.tensor(r, device=device, dtype=torch.long) for r in self._resident]
        self.entries = [first[layer] + h for layer, hs in enumerate(offloaded) for h in hs]
        # layer-major, as ``entries``: each one's layer, place, and that layer's width
        self._layer_of = torch.tensor([layer for layer, hs in enumerate(offloaded) for _ in hs],
                                      dtype=torch.long)  # fmt: skip
        self._head_of = torch.tensor([h for hs in offloaded for h in hs], dtype=torch.long)
        self._row_of = torch.tensor([i for hs in offloaded for i in range(len(hs))],
                                    dtype=torch.long)  # fmt: skip
        self._width_of = torch.tensor(layer_heads, dtype=torch.long)[self._layer_of]
        self._layer_entries = [torch.nonzero(self._layer_of == layer)[:, 0].to(device)
                               for layer in range(len(offloaded))]  # fmt: skip
        on_gpu = device.type == "cuda"
        self.copy_stream = shared_stream(device, COPY_PRIORITY) if on_gpu else None
        self.streamed_bytes = 0  # what the last decode step copied from host pages

    def any(self, layer: int) -> bool:
        return self.heads[layer].numel() > 0

    def host_slots(self, pages: list[int], positions: torch.Tensor) -> torch.Tensor:
        """Host slots ``[tokens]`` of ``positions`` in a sequence's host ``pages``."""
        return token_slots(device_ints(pages, positions.device), positions, self.page_size)

    # -- prefill -------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """``kv [2, tokens, kv_heads, dim]``'s offloaded heads into host ``slots [tokens]``."""
        heads = self.heads[layer]
        write_tokens(self.host.layer(layer), self.rows[layer], slots,
                     kv[:, :, heads].contiguous())  # fmt: skip

    def gather(self, layer: int, plane_slots: torch.Tensor, lo: int, hi: int,
               host_pages: list[int], width: int | None = None,
               only: list[int] | None = None) -> torch.Tensor:  # fmt: skip
        """K/V ``[2, kv_heads, width, dim]`` of a layer's keys ``lo .. hi - 1`` (``width``
        columns, default ``hi - lo``; columns past ``hi - 1`` repeat it) at its first
        ``kv_heads`` places (``plane_slots [kv_heads, positions]``, at least every offloaded
        one), or at the places ``only`` (in that order): resident ones from the plane,
        offloaded ones from host pages."""
        size, device = self.page_size, self.plane.device
        width = width or hi - lo
        first, last = lo // size, -(-hi // size)
        skip = lo - first * size  # keys copied from the page before ``lo``
        span = -(-max(skip + width, (last - first) * size) // size) * size  # whole pages
        places = list(range(plane_slots.shape[0])) if only is None else only
        offloaded = self.offloaded[layer]
        host = [(i, offloaded.index(p)) for i, p in enumerate(places) if p in offloaded]
        plane = [(i, p) for i, p in enumerate(places) if p not in offloaded]
        keys = self.plane.new_empty(2, len(places), span, self.plane.shape[-1])
        columns = torch.arange(lo, lo + width, device=device).clamp(max=hi - 1)
        if plane:
            into, held = device_ints(list(zip(*plane, strict=True)), device)
            picked = plane_slots[held[:, None], columns[None]]  # [heads, width]: no whole rows
            keys[:, into, skip : skip + width] = self.plane[:, picked]
        if host:
            into, rows = device_ints(list(zip(*host, strict=True)), device)
            pages = device_ints(host_pages[first:last], device)
            copy_pages(self.host.layer(layer), as_heads(keys, kv_first=True), pages,
                       torch.arange(last - first, device=device), rows, into, size)  # fmt: skip
            end = skip + hi - lo
            if width > hi - lo:  # padding columns repeat the last key, as the plane's do
                keys[:, into, end : skip + width] = keys[:, into, end - 1 : end]
        return keys[:, :, skip : skip + width]

    def compact(self, layer: int, keys: torch.Tensor, kept: list[torch.Tensor],
                host_pages: list[int]) -> None:  # fmt: skip
        """Move each offloaded head's ``kept[h]`` positions to the front of its host rows;
        ``keys [2, kv_heads, prompt, dim]`` is the layer's K/V gathered before."""
        heads = self.offloaded[layer]
        if not heads:
            return
        device = keys.device
        rows = [keys[:, h, kept[h].to(device)] for h in heads]  # [2, kept, dim] each
        counts = [len(kept[h]) for h in heads]
        index = torch.cat([torch.arange(n, device=device) for n in counts])
        slots = self.host_slots(host_pages, index)
        counts_on = device_ints(counts, device)
        owners = self.rows[layer].repeat_interleave(counts_on, output_size=sum(counts))
        write_tokens(self.host.layer(layer), owners, slots, torch.cat(rows, 1)[:, :, None],
                     paired=True)  # fmt: skip

    # -- decode --------------------------------------------------------------------------
    def begin_decode(self, lengths: list[list[int]], host_pages: list[list[int]],
                     tables) -> None:  # fmt: skip
        """Point the offloaded rows of ``tables [layers, seqs x kv_heads, width]`` (a list
        of layers when their widths differ) at their staging pages and plan each layer's
        copies; ``lengths[s][e]`` tokens of entry ``e`` of sequence ``s`` (the new one
        included), ``host_pages[s]`` its host pages."""
        size, device = self.page_size, self.plane.device
        num_seqs, layer_of, head_of = len(lengths), self._layer_of, self._head_of
        held = torch.tensor(lengths, dtype=torch.long)[:, self.entries].T  # [offloaded, seqs]
        # each (entry, seq) row's pages (the new token's included), consecutive within the
        # slot of its layer
        flat = ((held + size - 1) // size).flatten()
        starts = torch.cumsum(flat, 0) - flat
        layer_rows = layer_of.repeat_interleave(num_seqs)
        used = torch.zeros(len(self.heads), dtype=torch.long).index_add_(0, layer_rows, flat)
        assert int(used.max()) <= self.slot_pages, "staging slot smaller than planned"
        layer_first = torch.cumsum(used, 0) - used
        slot_first = self.first_page + (layer_rows % STAGING_DEPTH) * self.slot_pages
        first = slot_first + starts - layer_first[layer_rows]  # [rows]
        # the columns a row reads (the kernel reads none past its length: the rest keep
        # what they held)
        columns = torch.arange(int(flat.max()) if flat.numel() else 0)
        staged = torch.where(columns < flat[:, None], first[:, None] + columns, 0).int()
        rows = torch.arange(num_seqs).repeat(len(self.entries))
        rows = rows * self._width_of.repeat_interleave(num_seqs)
        rows += head_of.repeat_interleave(num_seqs)  # seq x kv_heads + kv head
        self._point(tables, layer_rows, rows, staged)
        # the copies: (host row, host page, plane page) per staged page, layer by layer
        pair_row = torch.arange(flat.numel()).repeat_interleave(flat)
        index = torch.arange(pair_row.numel()) - starts[pair_row]
        host_table = block_table(host_pages).long()  # [seqs, pages]
        pairs = torch.stack([self._row_of[pair_row // num_seqs],
                             host_table[pair_row % num_seqs, index],
                             first[pair_row] + index])  # fmt: skip
        self._plan_copies(pairs, pair_row, layer_rows[pair_row])
        # where each row's new token goes in host pages: [offloaded, seqs]
        new = new_token_slots(host_table.repeat(len(self.entries), 1), held.flatten() - 1, size)
        self.new_slots = device_ints(new.view_as(held), device)
        page_bytes = size * 2 * self.plane.shape[-1] * self.plane.element_size()
        self.streamed_bytes = int(flat.sum()) * page_bytes
        self._arrived, self._released = {}, [None] * STAGING_DEPTH
        if self.copy_stream is not None:  # host pages written by earlier steps are complete
            self.copy_stream.wait_stream(torch.cuda.current_stream(device))
        self._next = 0
        self._issue_ahead(0)

    def _point(self, tables, layer_rows: torch.Tensor, rows: torch.Tensor,
               staged: torch.Tensor) -> None:  # fmt: skip
        """``tables[layer_rows[i]][rows[i], :columns] = staged[i]`` (``staged [rows,
        columns]``, ``layer_rows`` ascending), the indices and values in one copy to the
        device."""
        packed = torch.cat([layer_rows[:, None], rows[:, None], staged.long()], dim=1)
        packed = device_ints(packed, self.plane.device)  # [rows, 2 + columns]
        num_columns = staged.shape[1]
        if isinstance(tables, torch.Tensor):
            tables[packed[:, 0], packed[:, 1], :num_columns] = packed[:, 2:].int()
            return
        counts = torch.bincount(layer_rows, minlength=len(tables)).tolist()
        for table, part in zip(tables, packed.split(counts), strict=True):
            if part.shape[0]:
                table[part[:, 1], :num_columns] = part[:, 2:].int()

    def _plan_copies(self, pairs: torch.Tensor, pair_row: torch.Tensor,
                     pair_layer: torch.Tensor) -> None:  # fmt: skip
        """Each layer's copies of ``pairs [3, pages]`` (host row, host page, plane page;
        ``pair_row``, ``pair_layer``: each page's row and layer, ascending): a row's run of
        at least :attr:`MIN_RUN_PAGES` consecutive host pages goes through the copy engine
        (one call per run for K and one for V: an entry's kept tokens are at the front of
        its host rows, so a sequence whose host pages are adjacent streams one run per
        entry), the other pages through the paired page kernel (``self.pairs``)."""
        num_pages, num_layers = pairs.shape[1], len(self.heads)
        run_start = torch.ones(num_pages, dtype=torch.bool)  # [pages] whether a run begins
        run_start[1:] = (pair_row[1:] != pair_row[:-1]) | (pairs[1, 1:] != pairs[1, :-1] + 1)
        run_of = torch.cumsum(run_start, 0) - 1  # [pages] the run of each page
        run_pages = torch.bincount(run_of, minlength=1)  # [runs] pages in each
        by_engine = run_pages[run_of] >= self.MIN_RUN_PAGES  # [pages] on the copy engine
        first = run_start & by_engine  # [pages] the first page of a copy-engine run
        self.runs = [[] for _ in range(num_layers)]  # [layer] (host row, host page, page, count)
        for layer, *run in torch.stack([pair_layer[first], *pairs[:, first],
                                        run_pages[run_of[first]]]).T.tolist():  # fmt: skip
            self.runs[layer].append(run)
        counts = torch.bincount(pair_layer[~by_engine], minlength=num_layers).tolist()
        kernel_pairs = device_ints(pairs[:, ~by_engine], self.plane.device)
        self.pairs = list(kernel_pairs.split(counts, dim=1))  # [layer] [3, pages]
        self.counters.run_pages += int(by_engine.sum())
        self.counters.kernel_pages += num_pages - int(by_engine.sum())

    def _has_copies(self, layer: int) -> bool:
        """Whether ``layer`` stages any page this step (by the kernel or a run)."""
        return self.pairs[layer].shape[1] > 0 or bool(self.runs[layer])

    def _copy(self, layer: int) -> None:
        src, page, dst = self.pairs[layer]
        host, size = self.host.layer(layer), self.page_size
        plane = self.plane.view(2, 1, -1, self.plane.shape[-1])
        if src.numel():
            copy_pages(host, as_heads(plane, kv_first=True), page, dst, src,
                       torch.zeros_like(src), size, paired=True)  # fmt: skip
        for row, host_page, first, count in self.runs[layer]:  # K, then V: contiguous
            src_rows = slice(host_page * size, (host_page + count) * size)
            for kv in range(2):
                self.plane[kv, first * size : (first + count) * size].copy_(
                    host[row, kv, src_rows], non_blocking=True
                )

    def _issue_ahead(self, layer: int) -> None:
        """Start the copies of the layers up to ``layer + depth - 1`` that have work."""
        last = min(layer + STAGING_DEPTH, len(self.heads))
        while self._next < last:
            target, self._next = self._next, self._next + 1
            if not self._has_copies(target) or self.copy_stream is None:
                continue
            released = self._released[target % STAGING_DEPTH]
            with torch.cuda.stream(self.copy_stream):
                if released is not None:
                    self.copy_stream.wait_event(released)
                self._copy(target)
                self._arrived[target] = torch.cuda.Event()
                self._arrived[target].record(self.copy_stream)

    def wait(self, layer: int) -> None:
        """Before ``layer``'s decode: its staged pages are in place."""
        if self.copy_stream is None:
            if self._has_copies(layer):
                self._copy(layer)
            return
        self._issue_ahead(layer)
        event = self._arrived.pop(layer, None)
        if event is not None:
            torch.cuda.current_stream(self.plane.device).wait_event(event)

    def done(self, layer: int, kv: torch.Tensor) -> None:
        """After ``layer``'s decode: free its slot and write its offloaded rows' new tokens
        ``kv [2, seqs, kv_heads, dim]`` to host pages."""
        if self.copy_stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.plane.device))
            self._released[layer % STAGING_DEPTH] = event
        rows = self._layer_entries[layer]
        if rows.numel() == 0:
            return
        heads = self.heads[layer]  # rows in entry order, then sequence
        new_kv = kv[:, :, heads].transpose(1, 2).flatten(1, 2)  # [2, heads x seqs, dim]
        owners = self.rows[layer].repeat_interleave(kv.shape[1])
        write_tokens(self.host.layer(layer), owners, self.new_slots[rows].flatten(),
                     new_kv[:, :, None].contiguous(), paired=True)  # fmt: skip
        self._issue_ahead(layer + 1)

"""Device memory of the KV arena: one flat buffer, allocated once at the size the budget gives
KV (``planner.memory``), so what the allocator reserves for KV never changes. Lanes take
contiguous parts of it (the resident lane the front, the offload lane the rest), and each
part is laid out per its head map into the pages of the resident entries and the staging
slots of streamed ones. Bookkeeping is elsewhere.

A page holds ``page_size`` tokens of every resident (layer, kv head) entry; with fewer
resident entries a page is smaller and more pages fit.
"""

from __future__ import annotations

import torch

from headspace.kv.spec import KVSpec


def token_slots(pages: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pool slots of logical ``positions`` (any shape) for a sequence's ``pages [pages]``."""
    return pages.long()[positions // page_size] * page_size + positions % page_size


def new_token_slots(tables: torch.Tensor, index: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pool slot ``[rows]`` int64 of each row's token at ``index [rows]`` of its pages
    (``tables [rows, pages]``); a negative index reads position 0."""
    index = index.long().clamp(min=0)
    page = tables.gather(1, (index // page_size)[:, None])[:, 0].long()
    return page * page_size + index % page_size


class KVArena:
    """The one device buffer of KV (``num_bytes``, in ``dtype`` elements on ``device``)."""

    def __init__(self, num_bytes: int, *, dtype: torch.dtype, device: torch.device | str):
        self.buffer = torch.zeros(num_bytes // dtype.itemsize, dtype=dtype, device=device)

    @property
    def num_bytes(self) -> int:
        return self.buffer.nbytes

    def part(self, start: int, end: int | None = None) -> torch.Tensor:
        """Bytes ``start .. end - 1`` of the buffer (a flat view; to its end without ``end``)."""
        size = self.buffer.element_size()
        return self.buffer[start // size : None if end is None else end // size]


def resident_bytes(spec: KVSpec, heads_per_layer: list[int], num_pages: int) -> int:
    """Bytes of a layout of ``num_pages`` pages (and the scratch page) of
    ``heads_per_layer`` resident heads, without staging or window."""
    return sum(heads_per_layer) * (num_pages + 1) * spec.entry_page_bytes


class PagedKVStore:
    """A part of the arena (``buffer``, a flat view) and its current layout.

    After :meth:`layout`, ``kv[layer]`` is ``[2, resident_heads, (num_pages + 1) * page_size,
    head_dim]`` (K then V; the last page is the scratch page of padded graph rows) and
    ``staging[i]`` is ``[2, group, (piece_pages + 1) * page_size, head_dim]`` (the last page
    is the slot's scratch page); with a GPU window (the hybrid tier's), ``window[layer]``
    is ``[2, heads, slots, head_dim]``. Token slot ``page * page_size + offset`` holds the
    token at ``offset`` of ``page``.
    """

    def __init__(self, spec: KVSpec, buffer: torch.Tensor):
        self.spec = spec
        self.kv: list[torch.Tensor] = []
        self.staging: list[torch.Tensor] = []
        self.window: list[torch.Tensor] = []
        self.num_pages = 0
        self.heads_per_layer: list[int] = []
        self.rebind(buffer)

    def rebind(self, buffer: torch.Tensor) -> None:
        """Take ``buffer`` (a flat view of the arena) as this store's part: a layout is laid
        anew over it (the views of a part that starts elsewhere are dropped)."""
        moved = not hasattr(self, "buffer") or buffer.data_ptr() != self.buffer.data_ptr()
        self.buffer = buffer
        if moved:
            self._views: dict[tuple, tuple[list[torch.Tensor], ...]] = {}
            self.kv, self.staging, self.window, self.num_pages = [], [], [], 0

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    @property
    def num_bytes(self) -> int:
        return self.buffer.nbytes

    def layout(self, heads_per_layer: list[int], num_pages: int,
               staging: tuple[int, int, int] | None = None,
               window: tuple[int, int, int] | None = None) -> None:  # fmt: skip
        """View the part as ``num_pages`` (+1 scratch) pages of ``heads_per_layer`` resident
        heads, ``staging = (depth, group, piece_pages)`` slots after them and ``window =
        (layers, heads, slots)`` after those. The same layout over the same part returns the
        same tensors (CUDA graphs captured over them stay valid)."""
        key = (tuple(heads_per_layer), num_pages, staging, window)
        if key not in self._views:
            self._views[key] = self._carve(heads_per_layer, num_pages, staging, window)
        self.kv, self.staging, self.window = self._views[key]
        self.num_pages, self.heads_per_layer = num_pages, list(heads_per_layer)

    def _carve(self, heads_per_layer, num_pages, staging, window):
        spec, offset = self.spec, 0
        slots = (num_pages + 1) * spec.page_size

        def take(*shape: int) -> torch.Tensor:
            nonlocal offset
            size = 1
            for dim in shape:
                size *= dim
            assert offset + size <= self.buffer.numel(), "layout exceeds the KV arena"
            view = self.buffer[offset : offset + size].view(shape)
            offset += size
            return view

        kv = [take(2, heads, slots, spec.head_dim) for heads in heads_per_layer]
        slots_staging = []
        if staging is not None:
            depth, group, piece_pages = staging
            slots_staging = [take(2, group, (piece_pages + 1) * spec.page_size, spec.head_dim)
                             for _ in range(depth)]  # fmt: skip
        window_pages = []
        if window is not None:
            layers, heads, window_slots = window
            window_pages = [take(2, heads, window_slots, spec.head_dim) for _ in range(layers)]
        return kv, slots_staging, window_pages

    def resize(self, num_pages: int, moves: list[tuple[int, int]], held: int) -> None:
        """The same resident heads over ``num_pages`` pages of this store's part (which holds
        the larger of the two layouts), keeping what the pages hold:
        held pages first move to their new numbers (``moves``: (old, new) pairs, every new
        page below ``held``), then each (layer, K/V, head)'s first ``held`` pages move to
        where the new layout puts them. Copies queued on the current stream, in an order
        that never overwrites a slot before it was read (a layout without staging or
        window: the resident lane's)."""
        size, heads = self.page_size, self.heads_per_layer
        if moves:
            old = torch.tensor([p * size + i for p, _ in moves for i in range(size)])
            new = torch.tensor([p * size + i for _, p in moves for i in range(size)])
            old, new = old.to(self.buffer.device), new.to(self.buffer.device)
            for kv in self.kv:
                kv.index_copy_(2, new, kv.index_select(2, old))
        dim = self.spec.head_dim
        before, after = (self.num_pages + 1) * size * dim, (num_pages + 1) * size * dim
        assert 2 * sum(heads) * max(before, after) <= self.buffer.numel(), "past the part"
        _move_segments(self.buffer, 2 * sum(heads), before, after, held * size * dim)
        self.layout(heads, num_pages)

    def slots(self, pages: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slots ``[tokens]`` of logical ``positions`` in a sequence whose pages are ``pages``."""
        return token_slots(pages, positions, self.page_size)

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store ``kv [2, tokens, kv_heads, dim]`` into token ``slots [tokens]``."""
        self.kv[layer].index_copy_(2, slots, kv.transpose(1, 2))


def _move_segments(flat: torch.Tensor, count: int, before: int, after: int, used: int) -> None:
    """Move the first ``used`` elements of ``count`` segments laid end to end in ``flat``,
    each ``before`` elements long, to segments ``after`` long: segment ``s`` from ``s *
    before`` to ``s * after``. Downwards in ascending order when they shrink, upwards in
    descending order when they grow, each in pieces no longer than its shift, so no piece
    overwrites what is still to be read."""
    if used == 0 or before == after:
        return
    order = range(1, count) if after < before else range(count - 1, 0, -1)
    for segment in order:
        source, target = segment * before, segment * after
        shift = abs(source - target)
        starts = list(range(0, used, shift))
        for start in starts if after < before else reversed(starts):
            end = min(start + shift, used)
            flat[target + start : target + end].copy_(flat[source + start : source + end])


__all__ = ["KVArena", "PagedKVStore", "new_token_slots", "resident_bytes", "token_slots"]

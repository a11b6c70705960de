"""Device memory of the KV arena: one flat buffer, laid out per head map into the pages of
the resident entries and the staging slots of streamed ones. Bookkeeping is elsewhere.

The buffer is allocated once, at the size the budget gives KV (``planner.memory``), so what
the allocator reserves for KV never changes; a new head map only re-views it. A page holds
``page_size`` tokens of every resident (layer, kv head) entry; with fewer resident entries a
page is smaller and more pages fit.
"""

from __future__ import annotations

import torch

from headspace.kv.spec import KVSpec


def token_slots(pages: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pool slots of logical ``positions`` (any shape) for a sequence's ``pages [pages]``."""
    return pages.long()[positions // page_size] * page_size + positions % page_size


class PagedKVStore:
    """The arena and its current layout.

    After :meth:`layout`, ``kv[layer]`` is ``[2, resident_heads, (num_pages + 1) * page_size,
    head_dim]`` (K then V; the last page is the scratch page of padded graph rows) and
    ``staging[i]`` is ``[2, group, (piece_pages + 1) * page_size, head_dim]`` (the last page
    is the slot's scratch page); with a GPU window (the hybrid tier's), ``window[layer]``
    is ``[2, heads, slots, head_dim]``. Token slot ``page * page_size + offset`` holds the
    token at ``offset`` of ``page``.
    """

    def __init__(self, spec: KVSpec, num_bytes: int, *, dtype: torch.dtype,
                 device: torch.device | str):  # fmt: skip
        self.spec = spec
        self.buffer = torch.zeros(num_bytes // dtype.itemsize, dtype=dtype, device=device)
        self.kv: list[torch.Tensor] = []
        self.staging: list[torch.Tensor] = []
        self.window: list[torch.Tensor] = []
        self.num_pages = 0
        self._views: dict[tuple, tuple[list[torch.Tensor], ...]] = {}

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    @property
    def num_bytes(self) -> int:
        return self.buffer.nbytes

    def layout(self, heads_per_layer: list[int], num_pages: int,
               staging: tuple[int, int, int] | None = None,
               window: tuple[int, int, int] | None = None) -> None:  # fmt: skip
        """View the arena as ``num_pages`` (+1 scratch) pages of ``heads_per_layer`` resident
        heads, ``staging = (depth, group, piece_pages)`` slots after them and ``window =
        (layers, heads, slots)`` after those. The same layout returns the same tensors (CUDA
        graphs captured over them stay valid)."""
        key = (tuple(heads_per_layer), num_pages, staging, window)
        if key not in self._views:
            self._views[key] = self._carve(heads_per_layer, num_pages, staging, window)
        self.kv, self.staging, self.window = self._views[key]
        self.num_pages = num_pages

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

    def slots(self, pages: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slots ``[tokens]`` of logical ``positions`` in a sequence whose pages are ``pages``."""
        return token_slots(pages, positions, self.page_size)

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store ``kv [2, tokens, kv_heads, dim]`` into token ``slots [tokens]``."""
        self.kv[layer].index_copy_(2, slots, kv.transpose(1, 2))

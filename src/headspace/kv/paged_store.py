"""Device memory of the paged pool: K/V of every page, every layer. Bookkeeping is elsewhere."""

from __future__ import annotations

import torch


class PagedKVStore:
    """Per layer one ``[2, kv_heads, num_pages * page_size, head_dim]`` tensor (K then V).

    Token slot ``page * page_size + offset`` holds the token at ``offset`` of ``page``;
    attention kernels index pages through block tables, so the layout per kv head stays
    contiguous in slots.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (2, num_kv_heads, num_pages * page_size, head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_pages, self.page_size = num_pages, page_size

    @staticmethod
    def bytes_per_page(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                       dtype: torch.dtype) -> int:  # fmt: skip
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * page_size * element

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    def slots(self, pages: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slots ``[tokens]`` of logical ``positions`` in a sequence whose pages are ``pages``."""
        return pages[positions // self.page_size] * self.page_size + positions % self.page_size

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store ``kv [2, tokens, kv_heads, dim]`` into token ``slots [tokens]``."""
        self.kv[layer].index_copy_(2, slots, kv.transpose(1, 2))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K and V ``[kv_heads, len(slots), dim]`` of the given slots, in order."""
        kv = self.kv[layer].index_select(2, slots)
        return kv[0], kv[1]

    def copy_page(self, src: int, dst: int) -> None:
        """Copy every layer's K/V of page ``src`` into page ``dst`` (a forked partial page)."""
        size = self.page_size
        for kv in self.kv:
            kv[:, :, dst * size : (dst + 1) * size] = kv[:, :, src * size : (src + 1) * size]

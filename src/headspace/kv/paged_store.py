"""Device memory of the paged pool: K/V of every page, every layer. Bookkeeping is elsewhere."""

from __future__ import annotations

import torch


def token_slots(pages: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pool slots of logical ``positions`` (any shape) for a sequence's ``pages [pages]``."""
    return pages.long()[positions // page_size] * page_size + positions % page_size


class PagedKVStore:
    """Per layer one ``[2, heads, num_pages * page_size, head_dim]`` tensor (K then V), for
    the layer's resident kv heads (all of them unless ``heads_per_layer`` says fewer).

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
        heads_per_layer: list[int] | None = None,
    ):
        heads_per_layer = heads_per_layer or [num_kv_heads] * num_layers
        self.kv = [
            torch.zeros(2, heads, num_pages * page_size, head_dim, dtype=dtype, device=device)
            for heads in heads_per_layer
        ]
        self.num_pages, self.page_size = num_pages, page_size

    def slots(self, pages: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slots ``[tokens]`` of logical ``positions`` in a sequence whose pages are ``pages``."""
        return token_slots(pages, positions, self.page_size)

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store ``kv [2, tokens, kv_heads, dim]`` into token ``slots [tokens]``."""
        self.kv[layer].index_copy_(2, slots, kv.transpose(1, 2))

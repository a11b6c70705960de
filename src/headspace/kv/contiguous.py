"""The simple KV cache: one static buffer per layer, head-major, sized to a capacity.

Later tiers (the paged pool, host offload) replace this behind the same three calls:
``write``, ``view`` and ``capacity``.
"""

from __future__ import annotations

import torch


class ContiguousKVCache:
    """K and V of one sequence: per layer one ``[2, kv_heads, capacity, head_dim]`` tensor."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (2, num_kv_heads, capacity, head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)

    def write(self, layer: int, start: int, kv: torch.Tensor) -> None:
        """Store ``kv [2, tokens, kv_heads, dim]`` at positions ``start .. start+tokens``."""
        end = start + kv.shape[1]
        assert end <= self.capacity, "KV cache overflow"
        self.kv[layer][:, :, start:end] = kv.transpose(1, 2)

    def view(self, layer: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[kv_heads, length, dim]`` (the whole buffer when ``length`` is None)."""
        kv = self.kv[layer] if length is None else self.kv[layer][:, :, :length]
        return kv[0], kv[1]

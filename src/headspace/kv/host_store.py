"""Host memory of streamed heads: one pinned ``[2, capacity, head_dim]`` tensor per
(layer, kv head), contiguous in tokens, so a group's history is a few large copies and a CPU
attention backend can read it in place. Only new tokens are ever written."""

from __future__ import annotations

import torch


class HostKVStore:
    """K/V of the streamed (layer, kv head) entries of one sequence, in host memory."""

    def __init__(
        self,
        streamed: list[tuple[int, int]],  # (layer, kv_head) entries kept here
        capacity: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        pin: bool,
    ):
        self.capacity = capacity
        self.kv = {
            key: torch.zeros(2, capacity, head_dim, dtype=dtype, pin_memory=pin) for key in streamed
        }

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv.values())

    def write(self, layer: int, kv_head: int, start: int, kv: torch.Tensor, *, non_blocking=False):
        """Store ``kv [2, tokens, head_dim]`` (any device) at positions ``start..``."""
        end = start + kv.shape[1]
        assert end <= self.capacity, "host KV store overflow"
        self.kv[(layer, kv_head)][:, start:end].copy_(kv, non_blocking=non_blocking)

    def read(self, layer: int, kv_head: int, length: int) -> torch.Tensor:
        """The first ``length`` tokens ``[2, length, head_dim]`` (a view, in host memory)."""
        return self.kv[(layer, kv_head)][:, :length]

"""Host memory of streamed heads: pinned K and V ``[capacity, head_dim]`` tensors per
(layer, kv head), contiguous in tokens, so a group's history is a few large contiguous
copies (asynchronous copies need contiguous pinned memory) and a CPU attention backend can
read it in place. Only new tokens are ever written."""

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

        def buffer() -> torch.Tensor:
            return torch.zeros(capacity, head_dim, dtype=dtype, pin_memory=pin)

        self.k = {key: buffer() for key in streamed}
        self.v = {key: buffer() for key in streamed}

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.k.values(), *self.v.values()])

    def write(self, layer: int, kv_head: int, start: int, k: torch.Tensor, v: torch.Tensor,
              *, non_blocking: bool = False) -> None:  # fmt: skip
        """Store ``k, v [tokens, head_dim]`` (contiguous, any device) at ``start..``."""
        end = start + k.shape[0]
        assert end <= self.capacity, "host KV store overflow"
        self.k[(layer, kv_head)][start:end].copy_(k, non_blocking=non_blocking)
        self.v[(layer, kv_head)][start:end].copy_(v, non_blocking=non_blocking)

    def read(self, layer: int, kv_head: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first ``length`` tokens (contiguous views in host memory)."""
        return self.k[(layer, kv_head)][:length], self.v[(layer, kv_head)][:length]

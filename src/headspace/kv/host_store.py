"""Host memory of streamed heads: K and V ``[capacity, head_dim]`` per (layer, kv head),
contiguous in tokens, so a group's history is a few large contiguous copies and a CPU
attention backend can read it in place. Only new tokens are ever written.

All entries share one buffer of exactly the size needed, page-locked by registering it with
CUDA. (torch's pinned allocator rounds every allocation up to a power of two: a 512K-token
context of Llama-3-8B would pin 128 GiB for 64 GiB of KV.)
"""

from __future__ import annotations

import weakref

import torch

from headspace.errors import UserError


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
        self._index = {key: i for i, key in enumerate(streamed)}
        # [entries, K/V, tokens, dim]; zero-filled by torch's parallel fill (touches every page)
        self.data = torch.zeros(len(streamed), 2, capacity, head_dim, dtype=dtype)
        if pin and self.data.numel() > 0:  # unregistered when the store is collected
            _register(self.data)
            weakref.finalize(self, _unregister, self.data)

    @property
    def num_bytes(self) -> int:
        return self.data.nbytes

    def entry(self, layer: int, kv_head: int) -> torch.Tensor:
        """K and V of one entry, ``[2, capacity, head_dim]`` (a view)."""
        return self.data[self._index[(layer, kv_head)]]

    def write(self, layer: int, kv_head: int, start: int, k: torch.Tensor, v: torch.Tensor,
              *, non_blocking: bool = False) -> None:  # fmt: skip
        """Store ``k, v [tokens, head_dim]`` (contiguous, any device) at ``start..``."""
        end = start + k.shape[0]
        assert end <= self.capacity, "host KV store overflow"
        entry = self.entry(layer, kv_head)
        entry[0, start:end].copy_(k, non_blocking=non_blocking)
        entry[1, start:end].copy_(v, non_blocking=non_blocking)

    def read(self, layer: int, kv_head: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first ``length`` tokens (contiguous views in host memory)."""
        entry = self.entry(layer, kv_head)
        return entry[0, :length], entry[1, :length]


def _register(buffer: torch.Tensor) -> None:
    """Page-lock ``buffer`` so host-device copies of it run asynchronously at full speed."""
    num_bytes = buffer.nbytes
    cudart = torch.cuda.cudart()
    status = cudart.cudaHostRegister(buffer.data_ptr(), num_bytes, 0)
    if int(status) != 0:
        raise UserError(
            f"cannot page-lock {num_bytes / 2**30:.2f} GiB of host memory for streamed KV "
            f"(CUDA error {int(status)}); lower --host-memory, the context, or raise the "
            "locked-memory limit"
        )


def _unregister(buffer: torch.Tensor) -> None:
    for device in range(torch.cuda.device_count()):  # no copy may still read or write it
        torch.cuda.synchronize(device)
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())

"""Streamed heads: their K/V live in host memory and are copied to the GPU one head group at
a time, each group's copy overlapping the previous group's attention.

Order of work for one forward pass (a prefill chunk or a decode step): the (layer, group)
pairs in layer order. While group ``i`` computes, group ``i + 1`` is copied host-to-device
into the other half of a double-buffered staging area (copy stream), and the new K/V of
group ``i - 1`` go device-to-host (write-back stream). Events order the streams; the host
never waits inside the loop. On the CPU the same code runs with plain copies.
"""

from __future__ import annotations

import torch

from headspace.attention import attend, decode_attend, merge_attention
from headspace.kv.host_store import HostKVStore
from headspace.planner.head_map import HeadMap


class HeadStreamer:
    """Attention for the streamed heads of every layer, with double-buffered staging."""

    def __init__(self, head_map: HeadMap, host: HostKVStore, group_size: int, capacity: int,
                 head_dim: int, *, dtype: torch.dtype, device: torch.device,
                 backend: str = "sdpa"):  # fmt: skip
        self.host, self.device, self.backend = host, device, backend
        self.order = [(layer, group) for layer in range(head_map.num_layers)
                      for group in head_map.stream_groups(layer)]  # fmt: skip
        self.index = {(layer, tuple(group)): i for i, (layer, group) in enumerate(self.order)}
        on_gpu = device.type == "cuda"
        shape = (2, group_size, capacity, head_dim)
        self.staging = (
            [torch.empty(shape, dtype=dtype, device=device) for _ in range(2)] if on_gpu else None
        )
        self.copy_stream = torch.cuda.Stream(device) if on_gpu else None
        self.write_stream = torch.cuda.Stream(device) if on_gpu else None
        self._arrived: dict[int, torch.cuda.Event] = {}  # staged group i is on the GPU
        self._released: list[torch.cuda.Event | None] = [None, None]  # staging half is free
        self._written: dict[tuple, torch.cuda.Event] = {}  # host copy of a group is current
        self._length = 0

    def begin(self, prefix: int) -> None:
        """Start a forward pass whose streamed heads hold ``prefix`` tokens so far."""
        self._length = prefix
        if self.staging is not None:
            self._length_t = torch.tensor([prefix], device=self.device)
        self._arrived.clear()
        if self.order and self.staging is not None:
            self._prefetch(0)

    def _prefetch(self, i: int) -> None:
        """Copy group ``i``'s history into staging half ``i % 2`` on the copy stream."""
        if i >= len(self.order) or i in self._arrived:
            return
        layer, group = self.order[i]
        half = i % 2
        with torch.cuda.stream(self.copy_stream):
            if self._released[half] is not None:
                self.copy_stream.wait_event(self._released[half])
            written = self._written.get((layer, tuple(group)))
            if written is not None:
                self.copy_stream.wait_event(written)
            for j, head in enumerate(group):
                k, v = self.host.read(layer, head, self._length)
                self.staging[half][0, j, : self._length].copy_(k, non_blocking=True)
                self.staging[half][1, j, : self._length].copy_(v, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        self._arrived[i] = event

    def _history(self, layer: int, group: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """K and V ``[group, prefix, dim]`` of the group, on the compute device."""
        if self.staging is None:
            parts = [self.host.read(layer, h, self._length) for h in group]
            return torch.stack([k for k, _ in parts]), torch.stack([v for _, v in parts]), -1
        i = self.index[(layer, tuple(group))]
        self._prefetch(i)
        torch.cuda.current_stream(self.device).wait_event(self._arrived.pop(i))
        self._prefetch(i + 1)  # the next group (maybe of the next layer) arrives meanwhile
        staged = self.staging[i % 2][:, : len(group), : self._length]
        return staged[0], staged[1], i

    def attend(self, layer: int, group: list[int], q: torch.Tensor, kv: torch.Tensor):
        """Attention of ``q [T, group * q_per_kv, D]`` for one streamed group.

        ``kv [2, T, group, D]`` are the chunk's new K/V (positions ``prefix..``): attended
        causally, merged with the history, then written back to host memory.
        """
        q_heads = q.transpose(0, 1)
        new_k, new_v = kv[0].transpose(0, 1), kv[1].transpose(0, 1)
        out, lse = attend(q_heads, new_k, new_v, causal=True, backend=self.backend)
        if self._length > 0:
            k, v, i = self._history(layer, group)
            if i >= 0 and q.shape[0] == 1:  # decode: split-K over the history fills the GPU
                past_out, past_lse = decode_attend(q_heads, k, v, self._length_t)
            else:
                past_out, past_lse = attend(q_heads, k, v, backend=self.backend)
            out, lse = merge_attention([out, past_out], [lse, past_lse])
            if i >= 0:  # the staging half may be refilled once this attention is done
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.device))
                self._released[i % 2] = done
        self._write_back(layer, group, kv)
        return out.transpose(0, 1)

    def _write_back(self, layer: int, group: list[int], kv: torch.Tensor) -> None:
        """Only the new tokens go to host memory (device-to-host on its own stream)."""
        new = kv.permute(0, 2, 1, 3).contiguous()  # [2, group, T, D]: contiguous per head
        if self.write_stream is None:
            for j, head in enumerate(group):
                self.host.write(layer, head, self._length, new[0, j], new[1, j])
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.write_stream):
            self.write_stream.wait_event(ready)
            for j, head in enumerate(group):
                self.host.write(layer, head, self._length, new[0, j], new[1, j], non_blocking=True)
            new.record_stream(self.write_stream)
            written = torch.cuda.Event()
            written.record(self.write_stream)
        self._written[(layer, tuple(group))] = written

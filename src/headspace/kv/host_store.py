"""Host pages: one page-locked arena ``[layers, kv_heads, 2, num_pages * page_size, head_dim]``.

Host page ``p`` holds tokens ``p * page_size ..`` of one sequence for *every* (layer, kv
head) entry, so a whole sequence can be swapped out and any entry can stream without a new
layout. Within an entry a page's K (or V) is one contiguous ``[page_size, head_dim]`` block
and a sequence's consecutive pages are adjacent: a CPU thread attends over them in place,
and GPU kernels read and write them through unified addressing (see ``kv.transfer``).

The arena is one buffer of exactly the size needed, page-locked by registering it with CUDA
(torch's pinned allocator rounds every allocation up to a power of two). It is allocated
when a batch first needs host pages and grows (copying what it holds) when a larger batch
does.
"""

from __future__ import annotations

import weakref

import torch

from headspace.errors import UserError
from headspace.kv.spec import GiB, KVSpec


class HostKVArena:
    """The host tier's pages (``data`` is None until the first page is needed): ``num_pages``
    for sequences and one scratch page after them (padded rows of a CUDA-graph step write
    there)."""

    def __init__(self, spec: KVSpec, dtype: torch.dtype, *, pin: bool, budget: int | None):
        self.spec, self.dtype, self.pin, self.budget = spec, dtype, pin, budget
        self.data: torch.Tensor | None = None
        self.num_pages = 0
        self.generation = 0  # counts reallocations (captured pointers go stale)

    @property
    def num_bytes(self) -> int:
        return self.data.nbytes if self.data is not None else 0

    @property
    def scratch_slot(self) -> int:
        return self.num_pages * self.spec.page_size

    def ensure(self, num_pages: int) -> bool:
        """Hold at least ``num_pages`` pages; returns whether the arena was reallocated
        (its old pages are copied over). Raises UserError beyond the host budget."""
        if num_pages <= self.num_pages:
            return False
        spec = self.spec
        grown = max(num_pages, self.num_pages + self.num_pages // 2)
        if self.budget is not None:
            limit = self.budget // spec.full_page_bytes - 1
            if num_pages > limit:
                raise UserError(
                    f"host pages for {num_pages * spec.page_size} tokens need "
                    f"{num_pages * spec.full_page_bytes / GiB:.2f} GiB, more than the "
                    f"{self.budget / GiB:.2f} GiB host budget (--host-memory)"
                )
            grown = min(grown, limit)
        shape = (spec.num_layers, spec.num_kv_heads, 2, (grown + 1) * spec.page_size, spec.head_dim)
        data = torch.zeros(shape, dtype=self.dtype)  # a parallel fill touches every page
        if self.data is not None:
            if self.pin:  # copies queued on the GPU may still read or write the old pages
                torch.cuda.synchronize()
            data[..., : self.data.shape[3], :].copy_(self.data)
        if self.pin and data.numel() > 0:
            page_lock(data, "KV pages", "lower --host-memory, the context, or")
        self.data, self.num_pages = data, grown
        self.generation += 1
        return True

    def layer(self, layer: int) -> torch.Tensor:
        """``[kv_heads, 2, slots, head_dim]`` of one layer (a view)."""
        return self.data[layer]


def page_lock(buffer: torch.Tensor, what: str, remedy: str) -> None:
    """Page-lock ``buffer`` (exactly its bytes) so copies reach it at full PCIe speed; it is
    unlocked when collected. ``what`` and ``remedy`` word the error: "cannot page-lock N
    GiB of host memory for {what}; {remedy} raise the locked-memory limit"."""
    num_bytes = buffer.nbytes
    status = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), num_bytes, 0)
    if int(status) != 0:
        raise UserError(
            f"cannot page-lock {num_bytes / GiB:.2f} GiB of host memory for {what} "
            f"(CUDA error {int(status)}); {remedy} raise the locked-memory limit"
        )
    weakref.finalize(buffer, _unregister, buffer.data_ptr())


def _unregister(pointer: int) -> None:
    for device in range(torch.cuda.device_count()):  # no copy may still read or write it
        torch.cuda.synchronize(device)
    torch.cuda.cudart().cudaHostUnregister(pointer)

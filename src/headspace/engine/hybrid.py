"""The hybrid tier's CPU side (HGCA): older tokens of offloaded (layer, kv head) entries are
attended by CPU threads where they lie in host pages, and only ``(out, lse)`` crosses PCIe.

Each offloaded entry's history is split per sequence at a page boundary ``cpu_end``: tokens
``0 .. cpu_end - 1`` are attended on the CPU, the rest (at least the ``gpu_window`` most
recent tokens) stream to the GPU as the stream tier's do. With ``cpu_share`` 1 the CPU takes
everything before the window (HGCA); below 1 the history splits between PCIe and the CPU in
that proportion so that both finish together. Exact either way: the parts merge by LSE.

The query goes to the host as soon as the layer computed it (a copy and an event); one
worker thread, never the thread driving CUDA, waits for it and runs the kernel with its own
CPU threads; the result comes back to the GPU when the layer collects it.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from headspace.attention.cpu_decode import cpu_paged_decode
from headspace.kv.host_store import HostKVArena


def cpu_ends(lengths: list[int], cpu_share: float, gpu_window: int, page_size: int) -> list[int]:
    """Tokens of each sequence attended on the CPU: ``cpu_share`` of what lies before the
    last ``gpu_window`` tokens (lengths exclude the new token), rounded down to a page."""
    ends = []
    for length in lengths:
        offloaded = max(length - gpu_window, 0)
        ends.append(int(offloaded * cpu_share) // page_size * page_size)
    return ends


class CpuAttention:
    """Attention of query heads over host pages by CPU threads, one job per layer (all its
    hybrid heads, the whole batch)."""

    def __init__(self, host: HostKVArena, num_threads: int | None = None):
        self.host, self.num_threads = host, num_threads
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="headspace-cpu")
        self.tables: torch.Tensor | None = None
        self.ends: torch.Tensor | None = None
        self.any = False  # whether this step gives the CPU any token

    def begin(self, host_pages: list[list[int]], ends: list[int]) -> None:
        """The step's host block tables ``[seqs, pages]`` and CPU token counts."""
        width = max(1, max(map(len, host_pages)))
        tables = torch.zeros(len(host_pages), width, dtype=torch.int32)
        for row, pages in enumerate(host_pages):
            tables[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.tables, self.ends = tables, torch.tensor(ends, dtype=torch.int32)
        self.any = any(ends)

    def submit(self, layer: int, kv_range: tuple[int, int], q: torch.Tensor) -> Future | None:
        """Start attending ``q [seqs, heads, dim]`` (the query heads of ``kv_range``)."""
        if not self.any:
            return None
        if q.is_cuda:
            q_host = torch.empty(q.shape, dtype=q.dtype, pin_memory=True)
            q_host.copy_(q, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(q.device))
        else:
            q_host, ready = q.clone(), None
        kv = self.host.layer(layer)[kv_range[0] : kv_range[1]]  # [heads, 2, slots, dim]
        return self.worker.submit(self._run, q_host, ready, kv, self.tables, self.ends)

    def _run(self, q: torch.Tensor, ready, kv: torch.Tensor, tables, ends):
        if ready is not None:
            ready.synchronize()
        out, lse = cpu_paged_decode(q, kv[:, 0], kv[:, 1], tables, ends, self.host.spec.page_size,
                                    num_threads=self.num_threads)  # fmt: skip
        return (out, lse) if ready is None else (out.pin_memory(), lse.pin_memory())

    @staticmethod
    def result(job: Future, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``out [seqs, heads, dim]`` fp32 and ``lse [seqs, heads]`` on ``device``."""
        out, lse = job.result()
        return out.to(device, non_blocking=True), lse.to(device, non_blocking=True)

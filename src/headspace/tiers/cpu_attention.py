"""Attention of query heads over host pages by CPU threads: the hybrid tier's CPU side.

The query goes to the host as soon as the layer computed it: its copy, then a flag's, on the
GPU's stream. A native thread (``BackgroundDecode``), never the thread driving CUDA, waits
for the flag and runs the kernel with its own CPU threads, without Python's GIL, so the CPU
starts the moment the query lands; the result comes back to the GPU when the layer collects
it. The sparse mode's rows need Python (selection, token tables): they run on a Python
worker thread that waits for the query's event instead.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from headspace.attention.cpu_decode import MAX_KERNEL_GROUP, cpu_paged_decode
from headspace.attention.cpu_jobs import BackgroundDecode
from headspace.kv.host_store import HostKVArena
from headspace.tiers.cpu_timings import CpuCall, CpuTimings, timed
from headspace.tiers.hybrid_sparse import SparseSelector


class CpuAttention:
    """Attention of query heads over host pages by CPU threads, one job per layer (all its
    hybrid heads, the whole batch). With ``sparse`` (set by the runner in sparse mode), rows
    with a selection attend only their kept tokens. ``timings``: a benchmark's record of
    the kernel calls and waits (:class:`CpuTimings`; None: nothing recorded)."""

    def __init__(self, host: HostKVArena, num_threads: int | None = None,
                 timings: CpuTimings | None = None):  # fmt: skip
        self.host, self.num_threads, self.timings = host, num_threads, timings
        self.spared = 0  # cores left to other threads this step (the runner sets it)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="headspace-cpu")
        self.sparse: SparseSelector | None = None
        self.tables: torch.Tensor | None = None
        self.ends: torch.Tensor | None = None
        self.any = False  # whether this step gives the CPU any token
        dense = BackgroundDecode.available(host.dtype)
        self.background = BackgroundDecode() if dense else None  # exact mode's jobs
        self.step_id = 0  # a job starts once its layer's flag holds its step's id
        self._flags: torch.Tensor | None = None  # [layers] int64, host
        self._counter: torch.Tensor | None = None  # the step's id, on the query's device
        self._pinned: dict[int, tuple[torch.Tensor, ...]] = {}  # layer -> q, out, lse buffers
        self._landed: dict[int, torch.cuda.Event] = {}  # ticket -> after its flag's copy

    @property
    def threads(self) -> int | None:
        """Threads of this step's jobs: ``num_threads`` less the cores ``spared``."""
        if self.num_threads is None or not self.spared:
            return self.num_threads
        return max(self.num_threads - self.spared, 1)

    def begin(self, host_pages: list[list[int]], ends: list[int]) -> None:
        """The step's host block tables ``[seqs, pages]`` and CPU token counts."""
        width = max(1, max(map(len, host_pages)))
        tables = torch.zeros(len(host_pages), width, dtype=torch.int32)
        for row, pages in enumerate(host_pages):
            tables[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.host_pages = host_pages
        self.tables, self.ends = tables, torch.tensor(ends, dtype=torch.int32)
        self.any = any(ends)
        if self.background is not None:
            self.background.drain()  # a step that raised may have left a job
            self._landed.clear()
        self.step_id += 1
        self._counted = False  # the device counter holds this step's id

    def submit(self, layer: int, kv_range: tuple[int, int], q: torch.Tensor) -> Future | int | None:
        """Start attending ``q [seqs, heads, dim]`` (the query heads of ``kv_range``)."""
        if not self.any:
            return None
        if self.timings is not None:
            self.timings.submitted.append(time.perf_counter())
        if self.sparse is None and self.background is not None:
            return self._submit_background(layer, kv_range, q)
        if q.is_cuda:
            q_host = torch.empty(q.shape, dtype=q.dtype, pin_memory=True)
            q_host.copy_(q, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(q.device))
        else:
            q_host, ready = q.clone(), None
        return self.worker.submit(self._run, q_host, ready, layer, kv_range)

    def _submit_background(self, layer: int, kv_range: tuple[int, int], q: torch.Tensor) -> int:
        """The exact mode: a native job that starts when the query's flag comes."""
        if self._flags is None:
            self._flags = torch.zeros(self.host.spec.num_layers, dtype=torch.int64,
                                      pin_memory=q.is_cuda)  # fmt: skip
        flag, out, lse = self._flags[layer : layer + 1], None, None
        if q.is_cuda:
            if self._counter is None:
                self._counter = torch.zeros((), dtype=torch.int64, device=q.device)
            if not self._counted:
                self._counter.fill_(self.step_id)
                self._counted = True
            q_host, out, lse = self._buffers(layer, q.shape)
            q_host.copy_(q.float(), non_blocking=True)
            flag.copy_(self._counter, non_blocking=True)  # after the query, on its stream
            landed = torch.cuda.Event()
            landed.record(torch.cuda.current_stream(q.device))
        else:
            q_host = torch.empty(q.shape).copy_(q)
            flag.fill_(self.step_id)
        kv = self.host.layer(layer)[kv_range[0] : kv_range[1]]  # [heads, 2, slots, dim]
        ticket = self.background.submit(q_host, kv[:, 0], kv[:, 1], self.tables, self.ends,
                                        self.host.spec.page_size, flag, self.step_id,
                                        num_threads=self.threads, out=out, lse=lse)  # fmt: skip
        if q.is_cuda:
            self._landed[ticket] = landed
        if self.timings is not None:
            self.timings.jobs.append(_kv_bytes(kv[:, 0], self.ends))
            self.timings.calls.append(_call(kv[:, 0], self.ends, self.host.spec.page_size, True))
        return ticket

    def _buffers(self, layer: int, shape: torch.Size) -> tuple[torch.Tensor, ...]:
        """Page-locked query and result buffers of ``layer``, reused every step (allocating
        page-locked memory synchronises the device). Safe: a layer's next query, and so
        its next job, comes after this step's results were copied up, on the same stream."""
        seqs, heads, dim = shape
        held = self._pinned.get(layer)
        if held is None or held[0].shape[0] < seqs or held[0].shape[1:] != (heads, dim):
            rows = max(seqs, held[0].shape[0] if held is not None else 0)
            held = (torch.empty(rows, heads, dim, pin_memory=True),
                    torch.empty(rows, heads, dim, pin_memory=True),
                    torch.empty(rows, heads, pin_memory=True))  # fmt: skip
            self._pinned[layer] = held
        return tuple(buffer[:seqs] for buffer in held)

    def _run(self, q: torch.Tensor, ready, layer: int, kv_range: tuple[int, int]):
        start = time.perf_counter() if self.timings is not None else 0.0
        if ready is not None:
            ready.synchronize()
        if self.timings is not None:
            self.timings.query.append(time.perf_counter() - start)
        if self.sparse is None:
            out, lse = self._dense(q, layer, kv_range)
        else:
            out, lse = self._rows(q, layer, kv_range)
        return (out, lse) if ready is None else (out.pin_memory(), lse.pin_memory())

    def _dense(self, q, layer: int, kv_range, rows=None, probs=None):
        """Every token before each row's CPU end, through its page table."""
        kv = self.host.layer(layer)[kv_range[0] : kv_range[1]]  # [heads, 2, slots, dim]
        tables, ends = self.tables, self.ends
        if rows is not None:
            q, tables, ends = q[rows], tables[rows], ends[rows]
        return self._kernel(q, kv[:, 0], kv[:, 1], tables, ends, self.host.spec.page_size,
                            probs=probs)  # fmt: skip

    def _kernel(self, q, k, v, tables, ends, page_size: int, probs=None):
        """:func:`cpu_paged_decode` on this object's threads, timed when ``timings`` is set."""
        start = time.perf_counter() if self.timings is not None else 0.0
        out = cpu_paged_decode(q, k, v, tables, ends, page_size, num_threads=self.threads,
                               probs=probs)  # fmt: skip
        if self.timings is not None:
            self.timings.kernel.append((time.perf_counter() - start, _kv_bytes(k, ends)))
            self.timings.calls.append(_call(k, ends, page_size, False))
        return out

    def _rows(self, q, layer: int, kv_range: tuple[int, int]):
        """Sparse mode: rows without a selection yet attend densely (the first of them also
        writes the weights a selection starts from), the others their kept tokens."""
        sparse, (lo, hi) = self.sparse, kv_range
        out, lse = torch.empty(q.shape), torch.empty(q.shape[:2])
        if sparse.dense:
            rows, probs = torch.tensor(sparse.dense), None
            if sparse.weigh:
                width = max(1, int(self.ends[rows].max()))
                probs = torch.empty(len(rows), q.shape[1], width)
            out[rows], lse[rows] = self._dense(q, layer, kv_range, rows, probs)
            for j, row in enumerate(sparse.dense):
                if row in sparse.weigh:
                    queries = sparse.prompt_queries(row, layer, int(self.ends[row]))
                    prompt = None if queries is None else \
                        self._query_probs(queries, layer, kv_range, row)  # fmt: skip
                    sparse.reevaluate(row, layer, kv_range, probs[j], int(self.ends[row]),
                                      prompt)  # fmt: skip
        if sparse.sparse:
            rows, num_heads, dim = torch.tensor(sparse.sparse), hi - lo, q.shape[-1]
            kv = self.host.layer(layer)  # [heads, 2, slots, dim], flat rows below
            slots, flat = kv.shape[2], kv.view(1, -1, dim)
            tables, counts = sparse.token_tables(layer, kv_range, self.host_pages, slots,
                                                 self.host.spec.page_size, q[rows],
                                                 kv)  # fmt: skip
            queries = q[rows].reshape(len(rows) * num_heads, -1, dim)
            part, part_lse = self._kernel(queries, flat[:, : flat.shape[1] - slots],
                                          flat[:, slots:], tables, counts, 1)  # fmt: skip
            out[rows] = part.view(len(rows), -1, dim)
            lse[rows] = part_lse.view(len(rows), -1)
        return out, lse

    def _query_probs(self, queries, layer: int, kv_range, row: int) -> torch.Tensor:
        """Softmax weights ``[queries, heads, end]`` of ``row``'s CPU-side tokens for each of
        ``queries [queries, heads, dim]`` (the prompt's last, each of which sees all those
        tokens: no mask). Each kernel call takes a few queries of a kv head as its query
        heads, so that it reads the K/V once for them all (once per sequence and layer: not
        in ``timings``, which records the steps' attention)."""
        kv = self.host.layer(layer)[kv_range[0] : kv_range[1]]  # [heads, 2, slots, dim]
        num_queries, num_heads, dim = queries.shape
        num_kv = kv_range[1] - kv_range[0]
        group, end = num_heads // num_kv, max(int(self.ends[row]), 1)
        probs = torch.empty(num_queries, num_heads, end)
        step = max(1, MAX_KERNEL_GROUP // group)  # queries per call
        for first in range(0, num_queries, step):
            part = queries[first : first + step]  # [n, heads, dim]
            n = part.shape[0]
            folded = part.view(n, num_kv, group, dim).transpose(0, 1).reshape(1, -1, dim)
            got = torch.empty(1, folded.shape[1], end)
            cpu_paged_decode(folded, kv[:, 0], kv[:, 1], self.tables[row : row + 1],
                             self.ends[row : row + 1], self.host.spec.page_size,
                             num_threads=self.threads, probs=got)  # fmt: skip
            probs[first : first + n] = got.view(num_kv, n, group, end).transpose(0, 1) \
                .reshape(n, num_heads, end)  # fmt: skip
        return probs

    @timed("result", stamps="collected")
    def result(self, job: Future | int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``out [seqs, heads, dim]`` fp32 and ``lse [seqs, heads]`` on ``device``."""
        if isinstance(job, int):
            landed = self._landed.pop(job, None)  # a query that never lands raises here
            out, lse = self.background.wait(job, None if landed is None else landed.query)
        else:
            out, lse = job.result()
        return out.to(device, non_blocking=True), lse.to(device, non_blocking=True)


def _kv_bytes(k: torch.Tensor, ends: torch.Tensor) -> int:
    """Bytes of K and V a kernel call reads: ``ends`` tokens of each row (sequence, or a
    sparse row's kept tokens) over the ``k.shape[0]`` kv heads of ``k [heads, slots, dim]``."""
    return int(ends.sum()) * k.shape[0] * 2 * k.shape[-1] * k.element_size()


def _call(k: torch.Tensor, ends: torch.Tensor, page_size: int, background: bool) -> CpuCall:
    """The record of a kernel call over ``k [heads, slots, dim]`` up to ``ends`` tokens of
    each row, in pages of ``page_size`` tokens."""
    return CpuCall(int(ends.sum()), k.shape[0], page_size, background)


__all__ = ["CpuAttention"]

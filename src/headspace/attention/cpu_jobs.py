"""The CPU decode kernel on a native background thread (``cpu_jobs.cpp``).

A job is queued at once and starts when its query has landed in host memory, which the
query's producer signals by writing a flag after it (on a GPU: the query's copy, then the
flag's, on one stream). Neither the wait nor the kernel needs a Python thread or the GIL, so
the thread that drives the GPU goes on launching work while the CPU attends.
"""

from __future__ import annotations

import weakref

import torch

from headspace.attention.cpu_decode import _DTYPES, BLOCK_TOKENS, _check, _library

WAIT_MS = 100  # a wait for a job returns to Python this often


class BackgroundDecode:
    """One native thread running :func:`~headspace.attention.cpu_decode.cpu_paged_decode`
    jobs in the order they were submitted."""

    def __init__(self):
        lib = _library()
        if lib is None:
            raise RuntimeError("the CPU attention kernel is not available")
        self._lib, self._handle = lib, lib.hs_runner_new()
        self._jobs: dict[int, tuple] = {}  # ticket -> the tensors the job reads and writes
        weakref.finalize(self, lib.hs_runner_free, self._handle)

    @staticmethod
    def available(dtype: torch.dtype) -> bool:
        """Whether jobs over K/V pages of ``dtype`` can run here (else use the twin)."""
        return dtype in _DTYPES and _library() is not None

    def submit(
        self,
        q: torch.Tensor,  # [seqs, heads, dim] fp32, host; its values may still be arriving
        k: torch.Tensor,  # [kv_heads, slots, dim] (rows contiguous)
        v: torch.Tensor,  # like k, same strides
        block_tables: torch.Tensor,  # [seqs, max_pages] int32
        ends: torch.Tensor,  # [seqs] int32: attend tokens 0..end-1 of each sequence
        page_size: int,
        flag: torch.Tensor,  # [1] int64, host: the job starts once it holds ``value`` or more
        value: int,
        *,
        num_threads: int | None = None,
        out: torch.Tensor | None = None,  # [seqs, heads, dim] fp32, contiguous: the result
        lse: torch.Tensor | None = None,  # [seqs, heads] fp32, contiguous
    ) -> int:
        """Queue decode attention of ``q`` over its pages; returns a ticket for :meth:`wait`.
        The results go to ``out`` and ``lse`` (new tensors where not given: a caller that
        copies them to a GPU asynchronously passes page-locked ones)."""
        _check(q, k, v, block_tables, ends, None, page_size)
        if q.dtype != torch.float32 or not q.is_contiguous() or k.dtype not in _DTYPES:
            raise ValueError("background jobs take a contiguous fp32 query, bf16 or fp32 K/V")
        if flag.dtype != torch.int64 or flag.device.type != "cpu" or flag.numel() != 1:
            raise ValueError("the flag is one int64 in host memory")
        num_seqs, num_heads, dim = q.shape
        num_kv_heads = k.shape[0]
        out = torch.empty(num_seqs, num_heads, dim) if out is None else out
        lse = torch.empty(num_seqs, num_heads) if lse is None else lse
        for name, tensor, shape in (("out", out, q.shape), ("lse", lse, q.shape[:2])):
            if (tensor.dtype != torch.float32 or tensor.shape != shape
                    or not tensor.is_contiguous()):  # fmt: skip
                raise ValueError(f"{name} must be contiguous fp32 {tuple(shape)}")
        ticket = self._lib.hs_runner_submit(
            self._handle, flag.data_ptr(), value, q.data_ptr(), k.data_ptr(), v.data_ptr(),
            _DTYPES[k.dtype], k.stride(0), block_tables.data_ptr(), block_tables.stride(0),
            ends.data_ptr(), num_seqs, num_kv_heads, num_heads // num_kv_heads, dim, page_size,
            dim**-0.5, BLOCK_TOKENS, num_threads or torch.get_num_threads(), out.data_ptr(),
            lse.data_ptr(),
        )  # fmt: skip
        self._jobs[ticket] = (q, k, v, block_tables, ends, flag, out, lse)
        return ticket

    def wait(self, ticket: int, check=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Block until job ``ticket`` is done; its ``(out, lse)``. The wait runs without the
        GIL in slices of ``WAIT_MS``, between which ``check()`` runs (a GPU event's ``query``
        raises the device's error, where a query that never lands would hang) and signals
        are delivered."""
        while (status := self._lib.hs_runner_wait(self._handle, ticket, WAIT_MS)) == -1:
            if check is not None:
                check()
        *_, out, lse = self._jobs.pop(ticket)
        if status != 0:
            raise ValueError(f"background CPU attention job failed (status {status})")
        return out, lse

    def drain(self) -> None:
        """Wait for every job not yet waited for and drop its results (a step that raised
        between a submit and its wait leaves one)."""
        for ticket in sorted(self._jobs):
            self.wait(ticket)

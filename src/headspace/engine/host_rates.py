"""The machine's rates the planner splits the hybrid tier by, measured once where it offloads:
the CPU attention kernel's read rate over host K/V and page-locked host-to-GPU copies.

The planner's defaults are one 16-core host's (55 GB/s for the CPU kernel, 54 GB/s over PCIe).
Hosts differ: a 64-core H200 host's hybrid step read its host K/V at about 100 GB/s at 512K
with the CPU taking all before the window, where the default share (0.5) left half the
history on PCIe for the step to wait for (bench/RESULTS.md). Measuring costs a buffer
larger than a host's last-level cache, filled once, and a few kernel calls and copies: 1.7 s
in a fresh process on a 64-core H100 host (CUDA's start-up and a 256 MiB copy included),
paid once, by an engine whose plan of shared pages offloads (in a server, by the first such
request: the running ones wait for it). Measured there: the CPU kernel 60 GB/s on 63
threads, copies 43 GB/s (a share of 0.58).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from headspace.attention.cpu_decode import cpu_paged_decode, kernel_isa
from headspace.planner.memory import Hardware

KV_BYTES = 1 << 30  # K and V read per kernel call: past the last-level caches of large hosts
COPY_BYTES = 64 << 20  # bytes per timed host-to-GPU copy (1.2 ms at 55 GB/s; its pinned
# buffer stays in torch's cache of page-locked blocks, beside the host arena's gigabytes)
REPEATS = 3  # timed calls; the fastest is the rate (the others met page faults or noise)


def _fastest(call: Callable[[], None], sync: Callable[[], None] = lambda: None) -> float:
    """Seconds of the fastest of ``REPEATS`` calls after one untimed call."""
    call()
    sync()
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        call()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def cpu_attention_rate(num_threads: int, kv_bytes: int = KV_BYTES) -> float:
    """Bytes/s at which the CPU kernel reads host K/V with ``num_threads`` threads: one
    decode query (4 query heads a kv head, dim 128) over ``kv_bytes`` of bf16 K/V in pages
    of 128 tokens, as the hybrid tier's jobs read them. 0 where the kernel is not built
    (the planner then never picks the hybrid tier)."""
    if kernel_isa() is None:
        return 0.0
    kv_heads, dim, page = 8, 128, 128
    slots = kv_bytes // (2 * kv_heads * dim * 2) // page * page  # K and V, bf16
    k = torch.full((kv_heads, slots, dim), 0.01, dtype=torch.bfloat16)  # [kv heads, slots, dim]
    v = torch.full_like(k, 0.02)  # written, so every page is its own (not the zero page)
    q = torch.ones(1, 4 * kv_heads, dim)  # [seqs, heads, dim]
    tables = torch.arange(slots // page, dtype=torch.int32)[None]  # [seqs, pages]
    ends = torch.tensor([slots], dtype=torch.int32)
    seconds = _fastest(lambda: cpu_paged_decode(q, k, v, tables, ends, page,
                                                num_threads=num_threads))  # fmt: skip
    return (k.nbytes + v.nbytes) / seconds


def h2d_rate(device: torch.device, num_bytes: int = COPY_BYTES) -> float:
    """Bytes/s of copies from page-locked host memory to ``device`` (a GPU)."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    seconds = _fastest(lambda: target.copy_(host, non_blocking=True),
                       lambda: torch.cuda.synchronize(device))  # fmt: skip
    return num_bytes / seconds


def measured_hardware(base: Hardware, device: torch.device, num_threads: int, *,
                      cpu: bool = True, ranks: bool = False) -> Hardware | None:  # fmt: skip
    """``base`` with this machine's host-to-GPU rate and, with ``cpu``, the CPU kernel's
    (else ``base``'s). Under torchrun (``ranks``) every rank measures at once and takes the
    slowest rank's rates, and a measurement that fails on any rank (host or GPU memory
    short) gives None on every rank: the caller keeps ``base``."""
    from headspace.parallel.dist import all_agree, host_min

    if ranks:
        all_agree(True)  # every rank here: they measure together, as they will run
    try:
        cpu_rate = cpu_attention_rate(num_threads) if cpu else base.cpu_attention_bytes
        h2d = h2d_rate(device)
        ok = True
    except (RuntimeError, MemoryError):  # torch's out-of-memory errors are RuntimeErrors
        cpu_rate, h2d, ok = 0.0, 0.0, False
    if ranks:
        ok = all_agree(ok)
        cpu_rate, h2d = (host_min(int(x)) for x in (cpu_rate, h2d))
    if not ok:
        return None
    return replace(base, cpu_attention_bytes=float(cpu_rate), h2d_bytes=float(h2d))


__all__ = ["cpu_attention_rate", "h2d_rate", "measured_hardware"]

"""The CPU attention kernel alone: GB/s of K/V read for a GQA decode over host pages, against
the host's read bandwidth and torch's CPU SDPA, measured in the same run.

    PYTHONPATH=src python bench/cpu_attention.py [--context 131072] [--layers 4]

Llama-3-8B shapes (8 kv heads x 4 query heads, head dim 128, bf16 K/V in 128-token pages in
the host arena's layout). Each call reads one layer; calls cycle over ``--layers`` layers, so
the buffers are several times the last-level cache. Prints a table; with --json writes
``cpu_attention_<host>_<date>.json`` (to $OUT when set).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from headspace.attention.cpu_decode import cpu_paged_decode, kernel_isa  # noqa: E402

GB = 1e9
PAGE, KV_HEADS, GROUP, DIM = 128, 8, 4, 128


def _timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def host_read_gb_s(num_bytes: int, threads: int) -> float:
    """torch's sum over a buffer far larger than the last-level cache."""
    torch.set_num_threads(threads)
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / _timed(lambda: buffer.sum(), 5) / GB


def kernel_gb_s(context: int, num_layers: int, threads: int, batch: int = 1) -> float:
    """K/V bytes read per second by the kernel, ``batch`` sequences of ``context`` tokens."""
    num_pages = batch * context // PAGE
    arena = torch.randn(num_layers, KV_HEADS, 2, num_pages * PAGE, DIM).to(torch.bfloat16)
    tables = torch.randperm(num_pages, dtype=torch.int32).view(batch, -1).contiguous()
    tables = tables.sort(dim=1).values.contiguous()  # ascending, as the host pool hands out
    ends = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, KV_HEADS * GROUP, DIM, dtype=torch.bfloat16)
    layer = [0]

    def one():
        kv = arena[layer[0] % num_layers]
        layer[0] += 1
        cpu_paged_decode(q, kv[:, 0], kv[:, 1], tables, ends, PAGE, num_threads=threads)

    seconds = _timed(one, 3 * num_layers)
    return batch * context * KV_HEADS * 2 * DIM * 2 / seconds / GB


def torch_sdpa_gb_s(context: int, threads: int, dtype=torch.bfloat16) -> float:
    torch.set_num_threads(threads)
    q = torch.randn(1, KV_HEADS * GROUP, 1, DIM).to(dtype)
    k = torch.randn(1, KV_HEADS, context, DIM).to(dtype)
    v = torch.randn_like(k)

    def one():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return context * KV_HEADS * 2 * DIM * k.element_size() / _timed(one, 3) / GB


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, nargs="*")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cores = torch.get_num_threads()
    threads = args.threads or sorted({1, max(cores // 2, 1), cores})
    arena_gib = args.layers * args.context * KV_HEADS * 2 * DIM * 2 / 2**30
    print(f"kernel ISA {kernel_isa()}, {cores} threads by default, arena {arena_gib:.1f} GiB")
    rows = []
    for n in threads:
        rows.append({"threads": n, "host_read_gb_s": host_read_gb_s(2 << 30, n),
                     "cpu_attention_gb_s": kernel_gb_s(args.context, args.layers, n),
                     "torch_cpu_sdpa_gb_s": torch_sdpa_gb_s(args.context, n)})  # fmt: skip
        print(rows[-1], flush=True)
    print(f"{'threads':>8} {'host read':>10} {'kernel':>8} {'share':>6} {'torch sdpa':>11}")
    for row in rows:
        share = row["cpu_attention_gb_s"] / row["host_read_gb_s"]
        print(f"{row['threads']:>8} {row['host_read_gb_s']:>10.1f} "
              f"{row['cpu_attention_gb_s']:>8.1f} {share:>6.2f} "
              f"{row['torch_cpu_sdpa_gb_s']:>11.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

"""What moving a run of a head group's host pages into a staging slot costs: one copy a
head and K/V (torch's ``copy_``) against two 2-D copies (``copy_rows``), the host's time a
call and the copy rate.

    PYTHONPATH=src python bench/profiles/run_copies.py

Llama-3.1-8B's pages (128 dims, bf16, 16 tokens a page) in page-locked host pages
``[heads, 2, slots, dim]``, into a slot ``[2, heads, slots, dim]`` on a side stream, as the
stream tier gathers a run: groups of 1, 4 and 8 kv heads, runs of 16 and 256 pages. For
each, ``host_us`` is the host's time to issue the run's copies (the median of 9 calls, the
copy stream drained before each) and ``gb_s`` the rate of 10 runs back to back (the bytes
of K and V over the time to drain them). Writes ``run_copies_<gpu>_<date>.json`` (to $OUT
when set).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from common import environment, gpu_tag, write_result  # noqa: E402
from headspace.kv.host_store import HostKVArena  # noqa: E402
from headspace.kv.spec import KVSpec  # noqa: E402
from headspace.kv.transfer import copy_rows  # noqa: E402

PAGE, DIM, MOST_HEADS, MOST_PAGES = 16, 128, 8, 256


def per_head(slot, host, heads: int, tokens: int) -> None:
    for kv in range(2):
        for j in range(heads):
            slot[kv, j, :tokens].copy_(host[j, kv, :tokens], non_blocking=True)


def two_d(slot, host, heads: int, tokens: int) -> None:
    for kv in range(2):
        copy_rows(slot[kv, :heads, :tokens], host[:heads, kv, :tokens])


def measure(fn, slot, host, heads: int, pages: int, stream) -> dict:
    tokens = pages * PAGE
    with torch.cuda.stream(stream):
        hosts = []
        for _ in range(9):
            stream.synchronize()
            started = time.perf_counter()
            fn(slot, host, heads, tokens)
            hosts.append(time.perf_counter() - started)
        stream.synchronize()
        started = time.perf_counter()
        for _ in range(10):
            fn(slot, host, heads, tokens)
        stream.synchronize()
        seconds = (time.perf_counter() - started) / 10
    moved = 2 * heads * tokens * DIM * slot.element_size()
    return {"host_us": statistics.median(hosts) * 1e6, "gb_s": moved / seconds / 1e9}


def main() -> None:
    host = HostKVArena(KVSpec(1, MOST_HEADS, PAGE, DIM, 2), torch.bfloat16, pin=True,
                       budget=None)  # fmt: skip
    host.ensure(MOST_PAGES)
    host.data.normal_()
    layer = host.layer(0)  # [heads, 2, slots, dim]
    slot = torch.empty(2, MOST_HEADS, MOST_PAGES * PAGE, DIM, device="cuda",
                       dtype=torch.bfloat16)  # fmt: skip
    stream = torch.cuda.Stream()
    rows = {}
    print(f"{'heads':>5}{'pages':>6}{'per head us':>13}{'2-D us':>8}{'per head GB/s':>15}"
          f"{'2-D GB/s':>10}")  # fmt: skip
    for heads in (1, 4, 8):
        for pages in (16, MOST_PAGES):
            row = {name: measure(fn, slot, layer, heads, pages, stream)
                   for name, fn in (("per_head", per_head), ("two_d", two_d))}  # fmt: skip
            rows[f"{heads}x{pages}"] = row
            print(f"{heads:>5}{pages:>6}{row['per_head']['host_us']:>13.1f}"
                  f"{row['two_d']['host_us']:>8.1f}{row['per_head']['gb_s']:>15.1f}"
                  f"{row['two_d']['gb_s']:>10.1f}")  # fmt: skip
    env = environment()
    write_result(f"run_copies_{gpu_tag(env)}_{env['date']}.json",
                 {"environment": env, "page": PAGE, "dim": DIM, "runs": rows})  # fmt: skip


if __name__ == "__main__":
    main()

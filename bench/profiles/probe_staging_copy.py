"""Probe of the budgeted staging copy (``engine.entry_staging``) on a GPU machine: each
offloaded (layer, kv head) entry's kept pages go from page-locked host pages to consecutive
staging pages of the plane. How fast is the engine's paired page kernel, against the copy
engine over each entry's contiguous run and against one contiguous copy (the floor)?

    PYTHONPATH=src python bench/profiles/probe_staging_copy.py [--kept-pages 256] [--entries 6]

The shape is SnapKV at 0.25 over 128K with heads offloaded (Llama-3.1-8B: 128-token pages of
128 dims in bf16, 32 KiB per K or V page, about 6 offloaded entries a layer). Prints one
table of GB/s; each figure is the median of three rounds over every variant, each round's
the median of five timings of 32 layers' copies.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from headspace.kv.host_store import page_lock
from headspace.kv.transfer import as_heads, copy_pages

PAGE, DIM, KV_HEADS, LAYERS, HOST_LAYERS = 128, 128, 8, 32, 8


@triton.jit
def _split_pages(SRC, DST, SRC_PAGES, DST_PAGES, SRC_HEADS, src_stride_h, src_stride_c,
                 dst_stride_c, PAGE_ELEMS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The paired page copy with one program per BLOCK of a page (more loads in flight)."""
    i, c, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    src_page = tl.load(SRC_PAGES + i).to(tl.int64)
    dst_page = tl.load(DST_PAGES + i).to(tl.int64)
    head = tl.load(SRC_HEADS + i).to(tl.int64)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    src = SRC + head * src_stride_h + c * src_stride_c + src_page * PAGE_ELEMS
    dst = DST + c * dst_stride_c + dst_page * PAGE_ELEMS
    tl.store(dst + offs, tl.load(src + offs))


def timed(fn, num_bytes: int) -> float:
    """GB/s of ``fn`` (the median of five runs after a warm-up)."""
    fn()
    rates = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        rates.append(num_bytes / (start.elapsed_time(end) / 1000) / 1e9)
    return statistics.median(rates)


def variants(kept: int, entries: int) -> tuple[dict, int]:
    """The copies of one step (32 layers; each layer's entries' ``kept`` front pages into
    consecutive staging pages) by each path, and the bytes they move."""
    host = torch.zeros(HOST_LAYERS, KV_HEADS, 2, 2 * kept * PAGE, DIM, dtype=torch.bfloat16)
    page_lock(host, "the probe", "")
    host.view(torch.int16).random_()
    plane = torch.empty(2, entries * kept * PAGE, DIM, dtype=torch.bfloat16, device="cuda")
    heads = torch.arange(entries, device="cuda").repeat_interleave(kept)
    src_pages = torch.arange(kept, device="cuda").repeat(entries)  # kept at the front
    dst_pages = torch.arange(entries * kept, device="cuda")
    dst_view = as_heads(plane.view(2, 1, -1, DIM), kv_first=True)
    span, per_layer = kept * PAGE, plane.numel()

    def engine_kernel():
        for layer in range(LAYERS):
            copy_pages(host[layer % HOST_LAYERS], dst_view, src_pages, dst_pages, heads,
                       torch.zeros_like(heads), PAGE, paired=True)  # fmt: skip

    def split_kernel(block: int, warps: int):
        def run():
            for layer in range(LAYERS):
                src = host[layer % HOST_LAYERS]
                grid = (src_pages.numel(), 2, PAGE * DIM // block)
                _split_pages[grid](src, plane, src_pages, dst_pages, heads, src.stride(0),
                                   src.stride(1), plane.stride(0), PAGE_ELEMS=PAGE * DIM,
                                   BLOCK=block, num_warps=warps)  # fmt: skip

        return run

    def copy_engine():
        for layer in range(LAYERS):
            src = host[layer % HOST_LAYERS]
            for e in range(entries):
                for c in range(2):
                    plane[c, e * span : (e + 1) * span].copy_(src[e, c, :span], non_blocking=True)

    def contiguous():
        for layer in range(LAYERS):
            start = (layer % HOST_LAYERS) * per_layer
            plane.view(-1).copy_(host.view(-1)[start : start + per_layer], non_blocking=True)

    paths = {"one contiguous copy a layer (floor)": contiguous,
             "engine paired page kernel": engine_kernel,
             "copy engine, one call per entry run": copy_engine}  # fmt: skip
    for block, warps in ((1024, 4), (4096, 8)):
        paths[f"split kernel block {block} warps {warps}"] = split_kernel(block, warps)
    return paths, LAYERS * entries * kept * 2 * PAGE * DIM * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kept-pages", type=int, default=256, help="kept pages per entry")
    parser.add_argument("--entries", type=int, default=6, help="offloaded entries per layer")
    args = parser.parse_args()
    if not 1 <= args.entries <= KV_HEADS:
        parser.error(f"--entries must be in 1..{KV_HEADS}")
    paths, num_bytes = variants(args.kept_pages, args.entries)
    rates = {name: [] for name in paths}
    for _ in range(3):  # rounds over every variant, so drifts of the host reach them alike
        for name, fn in paths.items():
            rates[name].append(timed(fn, num_bytes))
    print(f"\n{num_bytes / 1e9:.2f} GB a step ({args.entries} entries x {args.kept_pages} "
          f"pages x {LAYERS} layers)")  # fmt: skip
    for name, rate in rates.items():
        print(f"{name:<40}{statistics.median(rate):8.1f} GB/s  ({min(rate):.1f}-{max(rate):.1f})")


if __name__ == "__main__":
    main()

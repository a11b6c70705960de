"""Probe of the host tier's data paths on a GPU machine: how fast can kernels read and write
page-locked host memory in place (through unified addressing), against the copy engine?

    PYTHONPATH=src python bench/profiles/probe_host_tier.py

Prints one table; the numbers decide how streamed heads reach the GPU (see bench/NOTES.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent.parent))
from common import cuda_time  # noqa: E402

GiB = 2**30


@triton.jit
def _gather_pages(SRC, DST, PAGES, PAGE_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    part = tl.program_id(1)
    page = tl.load(PAGES + i).to(tl.int64)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(SRC + page * PAGE_ELEMS + offs)
    tl.store(DST + i.to(tl.int64) * PAGE_ELEMS + offs, x)


def register(t: torch.Tensor) -> None:
    status = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 0)
    assert int(status) == 0, status


def gather(src, dst, pages, page_elems, block=4096, warps=4):
    grid = (pages.numel(), page_elems // block)
    _gather_pages[grid](src, dst, pages, PAGE_ELEMS=page_elems, BLOCK=block, num_warps=warps)


def main() -> None:
    rows = []
    host = torch.empty(16 * GiB // 2, dtype=torch.bfloat16)
    host.view(torch.int16).random_(-1000, 1000)
    register(host)
    dev = torch.empty(2 * GiB // 2, dtype=torch.bfloat16, device="cuda")
    # copy engine, one large contiguous copy
    t = cuda_time(lambda: dev.copy_(host[: dev.numel()], non_blocking=True), warmup=2, repeat=5)
    rows.append(("copy engine H2D, 2 GiB contiguous", 2 * GiB / t / 1e9))
    t = cuda_time(lambda: host[: dev.numel()].copy_(dev, non_blocking=True), warmup=2, repeat=5)
    rows.append(("copy engine D2H, 2 GiB contiguous", 2 * GiB / t / 1e9))
    # kernel gather of random pages, several page sizes
    for page_kib in (32, 64, 256):
        elems = page_kib * 1024 // 2
        num_pages = 2 * GiB // (page_kib * 1024)
        total_pages = host.numel() // elems
        pages = torch.randperm(total_pages)[:num_pages].cuda()
        for block, warps in ((2048, 4), (4096, 8), (8192, 8)):
            if elems % block:
                continue
            t = cuda_time(lambda b=block, w=warps, p=pages, e=elems: gather(host, dev, p, e, b, w),
                          warmup=2, repeat=5)  # fmt: skip
            rows.append((f"kernel gather {page_kib} KiB pages, block {block} w{warps}",
                         2 * GiB / t / 1e9))  # fmt: skip
    # per-page copy-engine copies (one cudaMemcpyAsync per 256 KiB page)
    elems = 256 * 1024 // 2
    n = 1024
    idx = torch.randperm(host.numel() // elems)[:n].tolist()

    def per_page():
        for j, p in enumerate(idx):
            dev[j * elems : (j + 1) * elems].copy_(host[p * elems : (p + 1) * elems],
                                                   non_blocking=True)  # fmt: skip

    t = cuda_time(per_page, warmup=1, repeat=3)
    rows.append(("copy engine, one copy per 256 KiB page", n * 256 * 1024 / t / 1e9))
    # kernel write to host (scatter pages)
    pages = torch.randperm(host.numel() // elems)[: 2 * GiB // (256 * 1024)].cuda()

    @triton.jit
    def _scatter(SRC, DST, PAGES, PAGE_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0)
        part = tl.program_id(1)
        page = tl.load(PAGES + i).to(tl.int64)
        offs = part * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(SRC + i.to(tl.int64) * PAGE_ELEMS + offs)
        tl.store(DST + page * PAGE_ELEMS + offs, x)

    t = cuda_time(lambda: _scatter[(pages.numel(), elems // 4096)](dev, host, pages,
                  PAGE_ELEMS=elems, BLOCK=4096, num_warps=8), warmup=2, repeat=5)  # fmt: skip
    rows.append(("kernel scatter to host, 256 KiB pages", 2 * GiB / t / 1e9))
    # paged decode attention reading K/V straight from host pages (Llama-3-8B head shapes)
    from headspace.attention.triton_decode import paged_decode_attention

    for seqs, context in ((1, 131072), (8, 32768), (8, 65536)):
        heads, kv_heads, dim, page = 32, 8, 128, 128
        slots = seqs * context
        k = host[: kv_heads * slots * dim].view(kv_heads, slots, dim)
        v = host[kv_heads * slots * dim : 2 * kv_heads * slots * dim].view(kv_heads, slots, dim)
        perm = torch.randperm(slots // page, dtype=torch.int32).view(seqs, -1).cuda()
        q = torch.randn(seqs, heads, dim, dtype=torch.bfloat16, device="cuda")
        lengths = torch.full((seqs,), context, device="cuda")
        kg = torch.empty(kv_heads, slots, dim, dtype=torch.bfloat16, device="cuda")
        vg = torch.empty_like(kg)
        kg.copy_(k)
        vg.copy_(v)
        num_bytes = 2 * kv_heads * slots * dim * 2
        for splits in (None, 32, 64):
            args = (q, k, v, perm, lengths, page)
            t = cuda_time(lambda s=splits, a=args: paged_decode_attention(*a, num_splits=s),
                          warmup=2, repeat=5)  # fmt: skip
            rows.append((f"decode from host, {seqs}x{context // 1024}K, splits {splits}",
                         num_bytes / t / 1e9))  # fmt: skip
        out_h = paged_decode_attention(q, k, v, perm, lengths, page)[0]
        out_g = paged_decode_attention(q, kg, vg, perm, lengths, page)[0]
        assert torch.equal(out_h, out_g), "reading host pages must give the same result"
        args = (q, kg, vg, perm, lengths, page)
        t = cuda_time(lambda a=args: paged_decode_attention(*a))
        rows.append((f"decode from HBM, {seqs}x{context // 1024}K", num_bytes / t / 1e9))
    print(f"\n{'path':<52}{'GB/s':>8}")
    for name, rate in rows:
        print(f"{name:<52}{rate:>8.1f}")


if __name__ == "__main__":
    main()

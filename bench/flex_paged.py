"""FlexAttention over pages against the default kernels and contiguous FlexAttention: one
layer of Llama-3.1-8B (32 query heads, 8 kv heads, dim 128, bf16), pages of 128 tokens laid
out in a shuffled order, at 8K, 32K and 128K of context.

    PYTHONPATH=src python bench/flex_paged.py [--lengths 8 32 128] [--batch 8]

Per length, in one run: a prefill chunk of 8K queries (the last chunk of the context) by
``flex_paged`` (the ``flex`` backend: one call over the sequence's pages in place; its
block mask, built once per chunk for every layer, timed apart),
``flex_contiguous`` (the same attention over contiguous K/V: the paper's baseline) and
``cudnn_gather`` (the default: the chunk's causal block by cuDNN, the prefix gathered from
the pages in 32K pieces, attended by cuDNN, merged by LSE); and a decode step of ``--batch``
sequences by ``flex_paged``, ``flex_contiguous`` (one call over the batch's contiguous K/V) and
``triton`` (the default split-K kernel over the pages); the decode block mask, built once
per step for every layer, timed apart. Times are medians of CUDA-event
timings after a warm-up (which compiles). ``flex_paged_vs_contiguous``: the paper's overhead
of paging, time over time (target within 1.10 at prefill). Writes
``flex_paged_<gpu>_<date>.json`` (to $OUT when set).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).parent))
from common import cuda_time, environment, gpu_tag, write_result  # noqa: E402
from headspace.attention import attend, merge_attention  # noqa: E402
from headspace.attention.flex import (  # noqa: E402
    chunk_block_mask,
    decode_block_mask,
    flex_attention_dense,
    flex_paged_decode,
    flex_paged_prefill,
)
from headspace.attention.paged import gather_pages  # noqa: E402
from headspace.attention.triton_decode import paged_decode_attention  # noqa: E402

K = 1024
HEADS, KV_HEADS, DIM, PAGE, CHUNK, PIECE = 32, 8, 128, 128, 8 * K, 32 * K
DTYPE = torch.bfloat16
COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)


def pool_of(num_pages: int) -> torch.Tensor:
    """A pool ``[2, kv_heads, slots, dim]`` of random K/V."""
    return torch.randn(2, KV_HEADS, num_pages * PAGE, DIM,
                       device="cuda", dtype=DTYPE)  # fmt: skip


def prefill_row(length: int) -> dict:
    """The last 8K-query chunk of a ``length``-token sequence, three ways (ms)."""
    num_pages = length // PAGE
    pool = pool_of(num_pages + 8)
    pages = torch.randperm(num_pages + 8, device="cpu")[:num_pages].cuda()
    k, v = gather_pages(pool, pages, length, PAGE)  # contiguous [kv_heads, length, dim]
    q = torch.randn(HEADS, CHUNK, DIM, device="cuda", dtype=DTYPE)
    start = length - CHUNK

    def cudnn_gather():
        result = attend(q, k[:, start:], v[:, start:], causal=True)
        for first in range(0, start, PIECE):
            part_k, part_v = gather_pages(pool, pages, min(start, first + PIECE), PAGE, first)
            part = attend(q, part_k, part_v)
            result = merge_attention([result[0], part[0]], [result[1], part[1]])
        return result

    mask = chunk_block_mask(pages, start, CHUNK, pool.shape[2], PAGE)

    def flex_paged():
        return flex_paged_prefill(q, pool[0], pool[1], mask)

    def flex_contiguous():
        return flex_attention_dense(q, k, v, causal=True)

    def mask_build():
        return chunk_block_mask(pages, start, CHUNK, pool.shape[2], PAGE)

    return {"flex_paged": 1000 * cuda_time(flex_paged),
            "flex_contiguous": 1000 * cuda_time(flex_contiguous),
            "cudnn_gather": 1000 * cuda_time(cudnn_gather),
            "flex_paged_mask_build": 1000 * cuda_time(mask_build)}  # fmt: skip


def decode_row(length: int, batch: int) -> dict:
    """A decode step of ``batch`` sequences of ``length`` tokens, three ways (ms)."""
    per_seq = length // PAGE
    pool = pool_of(batch * per_seq + 8)
    order = torch.randperm(batch * per_seq).cuda()
    tables = order.view(batch, per_seq).int()
    lengths = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=DTYPE)
    contiguous = [gather_pages(pool, tables[b], length, PAGE) for b in range(batch)]
    k, v = (torch.stack([kv[i] for kv in contiguous]) for i in (0, 1))  # [batch, kv_heads, ..]
    del contiguous
    every_key = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 0, batch, None, 1,
                                  length, device="cuda")  # fmt: skip
    mask = decode_block_mask(tables, lengths, pool.shape[2], PAGE)  # once a step, all layers

    def flex_contiguous():  # one call over the batch's contiguous K/V
        return COMPILED_FLEX(q[:, :, None], k, v, block_mask=every_key, enable_gqa=True)

    def flex_paged():
        return flex_paged_decode(q, pool[0], pool[1], tables, lengths, PAGE, block_mask=mask)

    def triton():
        return paged_decode_attention(q, pool[0], pool[1], tables, lengths, PAGE)

    def mask_build():
        return decode_block_mask(tables, lengths, pool.shape[2], PAGE)

    return {"flex_paged": 1000 * cuda_time(flex_paged),
            "flex_contiguous": 1000 * cuda_time(flex_contiguous),
            "triton": 1000 * cuda_time(triton),
            "flex_paged_mask_build": 1000 * cuda_time(mask_build)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="*", default=[8, 32, 128],
                        help="contexts in K tokens")  # fmt: skip
    parser.add_argument("--batch", type=int, default=8, help="sequences in a decode step")
    args = parser.parse_args()
    env = environment()
    torch.manual_seed(0)
    result = {"env": env, "shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "dim": DIM,
              "page": PAGE, "prefill_chunk": CHUNK, "gather_piece": PIECE,
              "decode_batch": args.batch, "dtype": str(DTYPE)}, "lengths": {}}  # fmt: skip
    for length in args.lengths:
        prefill = prefill_row(length * K)
        decode = decode_row(length * K, args.batch)
        result["lengths"][f"{length}K"] = {"prefill_ms": prefill, "decode_ms": decode}
        torch.cuda.empty_cache()
    result["flex_paged_vs_contiguous"] = {
        label: {part: row[f"{part}_ms"]["flex_paged"] / row[f"{part}_ms"]["flex_contiguous"]
                for part in ("prefill", "decode")}
        for label, row in result["lengths"].items()
    }  # fmt: skip
    write_result(f"flex_paged_{gpu_tag(env)}_{env['date']}.json", result)
    print(f"\n{'length':>7} {'part':>8} {'flex paged':>11} {'flex contig':>12} {'default':>9}"
          f" {'paged/contig':>13} {'mask build':>11}")  # fmt: skip
    for label, row in result["lengths"].items():
        for part, default in (("prefill", "cudnn_gather"), ("decode", "triton")):
            times = row[f"{part}_ms"]
            ratio = result["flex_paged_vs_contiguous"][label][part]
            print(
                f"{label:>7} {part:>8} {times['flex_paged']:>11.2f} "
                f"{times['flex_contiguous']:>12.2f} {times[default]:>9.2f} {ratio:>13.2f} "
                f"{times['flex_paged_mask_build']:>11.2f}"
            )


if __name__ == "__main__":
    main()

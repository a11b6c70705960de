"""Decode-attention bandwidth sweep (Llama-3-8B heads), each setting timed as a CUDA graph of
32 layers, as the engine runs it; cuDNN SDPA (grouped heads) alongside for reference.
``--groups``: instead, one call per streamed head group's shape (one or two kv heads over a
staging slot, the default slices) with the merge kernel weighing its slices all at once
against in blocks of ``MERGE_SPLIT_BLOCK``.

    PYTHONPATH=src python bench/profiles/decode_attention.py [--contexts 8192,32768,131072]
        [--groups]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent.parent))
from common import environment, gpu_tag, graph_seconds, write_result  # noqa: E402
from headspace.attention import triton_decode  # noqa: E402
from headspace.attention.triton_decode import triton_decode_attention  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS = 32, 8, 128, 32


def sweep(context: int) -> None:
    """Print the best Triton settings and cuDNN's bandwidth at one context length."""
    shape = (2, KV_HEADS, context, DIM)
    layers = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    q = torch.randn(HEADS, 1, DIM, device="cuda", dtype=torch.bfloat16)
    length = torch.tensor([context], device="cuda")
    num_bytes = LAYERS * layers[0].numel() * 2
    results = []
    for splits, block_n, warps, stages in itertools.product(
        (16, 32, 64), (32, 64, 128), (4, 8), (2, 3)
    ):

        def run(splits=splits, block_n=block_n, warps=warps, stages=stages):
            for kv in layers:
                triton_decode_attention(
                    q,
                    kv[0],
                    kv[1],
                    length,
                    num_splits=splits,
                    block_n=block_n,
                    num_warps=warps,
                    num_stages=stages,
                )

        bandwidth = num_bytes / graph_seconds(run) / 1e12
        results.append((bandwidth, f"s{splits} n{block_n} w{warps} st{stages}"))
    for bandwidth, name in sorted(results, reverse=True)[:6]:
        print(f"{context:>8} {name:>22} {bandwidth:>6.2f}")

    def cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            for kv in layers:
                F.scaled_dot_product_attention(q[None], kv[0][None], kv[1][None], enable_gqa=True)

    try:
        bandwidth = num_bytes / graph_seconds(cudnn) / 1e12
        print(f"{context:>8} {'cudnn sdpa (gqa)':>22} {bandwidth:>6.2f}")
    except RuntimeError as exc:
        print(f"{context:>8} {'cudnn sdpa':>22} failed: {str(exc)[:60]}")


# (sequences, query heads, kv heads, tokens a sequence): streamed groups of one and two kv
# heads over slots of 16K-128K, and a whole layer's resident heads for comparison
GROUP_SHAPES = [
    (1, 4, 1, 16384), (1, 4, 1, 32768), (1, 4, 1, 65536), (1, 4, 1, 131072),
    (1, 8, 2, 65536), (4, 4, 1, 16384), (1, 32, 8, 8192), (1, 32, 8, 131072),
]  # fmt: skip


def group_calls() -> list[dict]:
    """Microseconds of one decode call (partial and merge kernels) per group shape, the merge
    weighing all slices at once against blocks of ``MERGE_SPLIT_BLOCK`` (20 calls a graph)."""
    rows, page = [], 128
    for seqs, heads, kv_heads, tokens in GROUP_SHAPES:
        q = torch.randn(seqs, heads, DIM, device="cuda", dtype=torch.bfloat16)
        num_pages = seqs * tokens // page
        k = torch.randn(kv_heads, num_pages * page, DIM, device="cuda", dtype=torch.bfloat16)
        table = torch.arange(num_pages, device="cuda", dtype=torch.int32).view(seqs, -1)
        lengths = torch.full((seqs,), tokens, device="cuda")
        out = torch.empty_like(q)
        row = {"seqs": seqs, "heads": heads, "kv_heads": kv_heads, "tokens": tokens}
        blocked = triton_decode.MERGE_SPLIT_BLOCK
        # (512: every shape's slices, 128-512, in one block, as the merge once weighed them)
        for name, block in (("all_at_once_us", 512), ("blocked_us", blocked)):
            triton_decode.MERGE_SPLIT_BLOCK = block

            def calls(q=q, k=k, table=table, lengths=lengths, out=out):
                for _ in range(20):
                    triton_decode.paged_decode_attention(q, k, k, table, lengths, page, out=out)

            row[name] = graph_seconds(calls) / 20 * 1e6
        triton_decode.MERGE_SPLIT_BLOCK = blocked
        print(f"{seqs:>4} {heads:>5} {kv_heads:>3} {tokens:>7} {row['all_at_once_us']:>9.1f} "
              f"{row['blocked_us']:>9.1f}")  # fmt: skip
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="8192,32768,131072")
    parser.add_argument("--groups", action="store_true",
                        help="time the streamed groups' shapes and the merge's blocks")  # fmt: skip
    args = parser.parse_args()
    if args.groups:
        header = f"{'seqs':>4} {'heads':>5} {'kv':>3} {'tokens':>7} {'at once':>9} {'blocked':>9}"
        print(header + " (us)")
        env = environment()
        rows = group_calls()
        result = {"environment": env, "merge_split_block": triton_decode.MERGE_SPLIT_BLOCK,
                  "calls": rows}  # fmt: skip
        write_result(f"decode_groups_{gpu_tag(env)}_{env['date']}.json", result)
        return
    print(f"{'context':>8} {'setting':>22} {'TB/s':>6}")
    for context in [int(c) for c in args.contexts.split(",")]:
        sweep(context)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

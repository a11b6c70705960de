"""Decode-attention bandwidth sweep (Llama-3-8B heads), each setting timed as a CUDA graph of
32 layers, as the engine runs it; cuDNN SDPA (grouped heads) alongside for reference.

    PYTHONPATH=src python bench/decode_attention.py [--contexts 8192,32768,131072]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import graph_seconds  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="8192,32768,131072")
    args = parser.parse_args()
    print(f"{'context':>8} {'setting':>22} {'TB/s':>6}")
    for context in [int(c) for c in args.contexts.split(",")]:
        sweep(context)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

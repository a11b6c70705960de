"""Decode attention over per-entry rows of uneven lengths (a KV budget's or DuoAttention's
layers: some kv heads keep most of a 128K prompt, streaming ones 1028 tokens), timed as a
CUDA graph of 32 layers at the default key slices and at 2x, 4x and 8x as many, against the
same bytes in rows of equal length and the device's copy bandwidth measured in the run.
``--append`` also stores each row's new token as it attends it, as the engine's decode does.

    PYTHONPATH=src python bench/profiles/entry_splits.py [--context 131072] [--append]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from common import environment, gpu_tag, graph_seconds, measure_hbm_bandwidth, write_result  # noqa: E402
from headspace.attention.triton_decode import num_splits_for, paged_decode_attention  # noqa: E402

GROUP, DIM, LAYERS, PAGE = 4, 128, 32, 128
SHARES = {  # each layer's 8 rows as shares of the context (a streaming row: 1028 tokens)
    "duo": [0.9, 0.6, 0.35, 0.15, None, None, None, None],
    "ada_snapkv": [0.7, 0.45, 0.3, 0.25, 0.15, 0.1, 0.03, 0.02],
    "even": [0.25] * 8,
    # a batch of four prompts under Ada-SnapKV at 0.25 on the sharpened model of
    # bench/multigpu.py (a layer's measured shares, times 0.25): 32 rows
    "ada_snapkv_b4": [0.459, 0.05, 0.05, 0.05, 0.05, 0.501, 0.265, 0.575] * 4,
    "even_b4": [0.25] * 32,
}
# tables as wide as the whole context (the engine pads a step's tables to a power of two of
# its widest entry's pages, the widest of every layer: 0.95 of 128K in that batch)
FULL_WIDTH = {"ada_snapkv_b4"}


def make_layers(context: int, shares: list, full_width: bool = False
                ) -> tuple[list, torch.Tensor, torch.Tensor, int]:  # fmt: skip
    """32 entry planes ``[2, slots, dim]``, the rows' tables ``[rows, width]`` (pages in
    random order; as wide as the longest row, or as the context) and lengths ``[rows]``;
    returns them and the tokens of one layer."""
    lengths = [1028 if s is None else int(s * context) for s in shares]
    pages = [-(-n // PAGE) for n in lengths]
    width = -(-context // PAGE) if full_width else max(pages)
    order = torch.randperm(sum(pages))
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    first = 0
    for row, n in enumerate(pages):
        tables[row, :n] = order[first : first + n]
        first += n
    planes = [
        torch.randn(2, sum(pages) * PAGE, DIM, device="cuda", dtype=torch.bfloat16)
        for _ in range(LAYERS)
    ]
    lengths_t = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    return planes, tables.cuda(), lengths_t, sum(lengths)


def measure(context: int, shape: str, factors: tuple[int, ...], append: bool) -> dict:
    """Per slice count (``factors`` times the default): ms per 32 layers, TB/s of K/V read,
    and the output's largest difference from the default's; ``append``: each row's new
    token ``[2, rows, 1, dim]`` stored at its last position as it is attended."""
    planes, tables, lengths, tokens = make_layers(context, SHARES[shape], shape in FULL_WIDTH)
    q = torch.randn(len(SHARES[shape]), GROUP, DIM, device="cuda", dtype=torch.bfloat16)
    new_kv = torch.randn(2, len(SHARES[shape]), 1, DIM, device="cuda", dtype=torch.bfloat16)
    num_bytes = LAYERS * tokens * 2 * DIM * 2
    default = num_splits_for(tables.shape[1] * PAGE, tables.shape[0])
    row = {"tokens_per_layer": tokens, "default_splits": default}
    reference = None
    for factor in factors:

        def run(factor=factor, planes=planes):
            return [paged_decode_attention(q, plane[0][None], plane[1][None], tables, lengths,
                                           PAGE, num_splits=default * factor,
                                           new_kv=new_kv if append else None)[0]
                    for plane in planes]  # fmt: skip

        out = run()[0]
        reference = out if reference is None else reference
        seconds = graph_seconds(run)
        difference = float((out - reference).abs().max())
        row[f"splits x{factor}"] = {"ms": seconds * 1000, "tb_s": num_bytes / seconds / 1e12,
                                    "max_abs_diff": difference}  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--append", action="store_true", help="store each row's new token")
    args = parser.parse_args()
    factors = (1, 2, 4, 8)
    env = environment()
    hbm = measure_hbm_bandwidth()  # a device copy's bytes read plus written per second
    result = {"environment": env, "context": args.context, "layers": LAYERS, "group": GROUP,
              "page_size": PAGE, "shares": SHARES, "append": args.append,
              "copy_tb_s": hbm / 1e12}  # fmt: skip
    for shape in SHARES:
        result[shape] = measure(args.context, shape, factors, args.append)
        torch.cuda.empty_cache()
    suffix = "_append" if args.append else ""
    write_result(f"entry_splits{suffix}_{gpu_tag(env)}_{env['date']}.json", result)
    names = [f"splits x{f}" for f in factors]
    print(f"a device copy moves {hbm / 1e12:.2f} TB/s; ms per 32 layers (TB/s of K/V read)")
    print(f"{'rows':<12}" + "".join(f"{n:>16}" for n in names))
    for shape in SHARES:
        cells = [f"{result[shape][n]['ms']:.2f} ({result[shape][n]['tb_s']:.2f})" for n in names]
        print(f"{shape:<12}" + "".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()

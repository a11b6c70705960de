"""What a new prompt length costs at prefill (Llama-3.1-8B architecture, random bf16 weights,
default options): the first request of a length against a second one of the same length
(other tokens: nothing reused), with cuDNN's calls over exactly the prompt's rows ("plain")
and padded to whole multiples of ``attention.sdpa.CUDNN_ROWS`` rows (the default, "padded").

    PYTHONPATH=src python bench/profiles/prompt_lengths.py [--num-lengths 12] [--low 9000]
        [--high 30000]

cuDNN builds an execution plan for each new shape; a prompt's last chunk has a new row count
at each new length. Padded, cuDNN's shapes depend only on the length rounded up to the row
unit, so a length whose rounded length was seen before builds none: the run times new
lengths twice, first in buckets new to the process, then new lengths in the buckets the first
set opened. Writes ``prompt_lengths_<gpu>_unit<rows>_<date>.json`` to bench/results ($OUT
when set).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from common import (  # noqa: E402
    LLAMA31_8B,
    environment,
    gpu_tag,
    make_engine,
    ran_view,
    random_model,
    write_result,
)
from headspace.attention import sdpa  # noqa: E402
from headspace.engine.sampling import SamplingParams  # noqa: E402

MODES = {"plain": 1, "padded": sdpa.CUDNN_ROWS}  # cuDNN's row unit in each


def request_seconds(engine, length: int, seed: int) -> float:
    """Wall seconds of one request of ``length`` random tokens and one new token."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, LLAMA31_8B["vocab_size"], (length,), generator=generator).tolist()
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate_batch([ids], [params])
    torch.cuda.synchronize()
    return time.perf_counter() - start


def lengths_sets(count: int, low: int, high: int, unit: int) -> tuple[list[int], list[int]]:
    """``count`` lengths in distinct row-unit buckets (none a multiple of the unit), and as
    many other lengths in the same buckets."""
    rng = random.Random(0)
    buckets = rng.sample(range(low // unit + 1, high // unit), count)
    first = [b * unit + rng.randrange(1, unit // 2) for b in buckets]
    second = [b * unit + rng.randrange(unit // 2, unit) for b in buckets]
    return first, second


def time_set(engine, mode: str, lengths: list[int], seed: int) -> dict:
    """First and second request of each length under ``mode``: per length, and medians."""
    sdpa.CUDNN_ROWS = MODES[mode]
    rows = []
    for i, length in enumerate(lengths):
        first = request_seconds(engine, length, seed + 2 * i)
        second = request_seconds(engine, length, seed + 2 * i + 1)
        rows.append({"length": length, "first_s": first, "second_s": second})
    tokens = sum(lengths)
    return {
        "lengths": rows,
        "extra_ms_median": statistics.median(1000 * (r["first_s"] - r["second_s"]) for r in rows),
        "first_tok_s": tokens / sum(r["first_s"] for r in rows),
        "second_tok_s": tokens / sum(r["second_s"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-lengths", type=int, default=12)
    parser.add_argument("--low", type=int, default=9000)
    parser.add_argument("--high", type=int, default=30000)
    parser.add_argument("--unit", type=int, default=sdpa.CUDNN_ROWS, help="padded's row unit")
    args = parser.parse_args()
    MODES["padded"] = args.unit
    unit = MODES["padded"]
    new_buckets, seen_buckets = lengths_sets(args.num_lengths, args.low, args.high, unit)
    engine = make_engine(random_model(LLAMA31_8B))
    for mode in MODES:  # the process's first odd shapes (about a second each) out of the way
        sdpa.CUDNN_ROWS = MODES[mode]
        request_seconds(engine, args.low - 500, seed=10**6)
    runs = {}
    for mode in MODES:  # plain's shapes are whole prompts, padded's whole units: none shared
        runs[mode] = {"new_buckets": time_set(engine, mode, new_buckets, seed=1000),
                      "seen_buckets": time_set(engine, mode, seen_buckets, seed=2000)}  # fmt: skip
    sdpa.CUDNN_ROWS = unit
    env = environment()
    result = {
        "environment": env,
        "config": {"model": "Llama-3.1-8B architecture, random bf16 weights",
                   "options": "default", "prefill_chunk": engine.lanes.chunk,
                   "cudnn_rows": unit, "low": args.low, "high": args.high},
        "head_map": ran_view(engine).layout,
        "runs": runs,
    }  # fmt: skip
    write_result(f"prompt_lengths_{gpu_tag(env)}_unit{unit}_{env['date']}.json", result)
    print(f"{'mode':<6} {'lengths':<13} {'extra ms (median)':>18} {'first tok/s':>12} "
          f"{'second tok/s':>13}")  # fmt: skip
    for mode, sets in runs.items():
        for name, r in sets.items():
            print(f"{mode:<6} {name:<13} {r['extra_ms_median']:>18.1f} {r['first_tok_s']:>12.0f} "
                  f"{r['second_tok_s']:>13.0f}")  # fmt: skip


if __name__ == "__main__":
    main()

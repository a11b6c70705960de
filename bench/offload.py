"""Head-wise offload benchmark, Llama-3-8B architecture with random bf16 weights.

    PYTHONPATH=src python bench/offload.py --part max     # maximum context per system
    PYTHONPATH=src python bench/offload.py --part speed   # 32K / 128K (+ 512K resident)
    PYTHONPATH=src python bench/offload.py --part long    # 512K: head, layer
    python bench/offload_report.py DIR                    # merge parts: JSON, PNGs, table

Offloaded runs cap the GPU at 24 GiB (``set_per_process_memory_fraction``); the no-offload
reference runs on the uncapped GPU. Each part writes ``offload_part_<part>.json`` (to $OUT
when set, else bench/results/parts), a row at a time, so a part cut short keeps its rows.
The parts are three commands only because one command may run at most ten minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import LLAMA3_8B, environment, pinned_h2d_bandwidth, random_model  # noqa: E402
from offload_runs import (  # noqa: E402
    compute_rates,
    gpu_cap,
    headspace_run,
    planner_limit,
    prefill_roofline_tok_s,
    transformers_run,
)

CAP_GIB = 24
LOW_BUDGET = "17GiB"  # head offload's target peak at 512K
CAP_BUDGET = f"{CAP_GIB - 2}GiB"  # the cap less room for CUDA workspaces and fragmentation
STEPS = 16  # decode tokens after every prefill
K = 1024
LADDER = [16 * K, 32 * K, 40 * K, 48 * K, 64 * K, 80 * K, 96 * K, 128 * K, 192 * K, 256 * K]


class Part:
    """Rows of one part, rewritten to disk after each one."""

    def __init__(self, name: str):
        out = Path(os.environ.get("OUT") or Path(__file__).parent / "results" / "parts")
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / f"offload_part_{name}.json"
        self.data = {"part": name, "env": environment(), "config": LLAMA3_8B,
                     "gpu_cap_gib": CAP_GIB, "rows": []}  # fmt: skip

    def add(self, system: str, length: int, row: dict) -> None:
        self.data["rows"].append({"system": system, "length": length, **row})
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")
        shown = {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
        print(f"{system:>14} {length:>8}: {shown}", flush=True)


def ladder(part: Part, system: str, run, lengths: list[int]) -> None:
    """Run increasing lengths until the first that does not fit."""
    for length in tqdm(lengths, desc=system, file=sys.stderr):
        row = run(length)
        part.add(system, length, row)
        if not row["ok"]:
            return


def part_max(part: Part) -> None:
    """Longest prompt (+ 16 decode tokens) per system with the GPU capped at 24 GiB."""
    _transformers_ladders(part)
    torch.cuda.empty_cache()
    model = random_model(LLAMA3_8B)
    with gpu_cap(CAP_GIB):
        ladder(part, "none", lambda n: headspace_run(model, n, "none", CAP_BUDGET, STEPS), LADDER)
    # layer and head are limited by host RAM: their runs are the long part (512K); here the
    # planner's limit on this host, found without running anything
    limits = {mode: planner_limit(mode, CAP_BUDGET) for mode in ("layer", "head")}
    part.data["planner_limit"] = limits


def _transformers_ladders(part: Part) -> None:
    from common import random_hf_llama

    hf = random_hf_llama(LLAMA3_8B)
    with gpu_cap(CAP_GIB):
        for system, offloading in (("transformers", False), ("transformers_offload", True)):
            ladder(part, system, lambda n, o=offloading: transformers_run(hf, n, o, STEPS), LADDER)


def part_speed(part: Part, reference_512k: bool) -> None:
    """Prefill and decode at 32K and 128K: no offload (uncapped) vs head offload (capped)."""
    part.data["pinned_h2d_bytes_per_s"] = pinned_h2d_bandwidth()
    part.data["compute_rates"] = rates = compute_rates()
    model = random_model(LLAMA3_8B)
    lengths = [32 * K, 128 * K] + ([512 * K] if reference_512k else [])
    for length in lengths:
        roofline = prefill_roofline_tok_s(length, rates)
        part.add("none", length, {**headspace_run(model, length, "none", None, STEPS),
                                  "prefill_roofline_tok_s": roofline})  # fmt: skip
        if length == 512 * K:
            break  # the offloaded 512K runs are the long part
        with gpu_cap(CAP_GIB):
            for budget in (LOW_BUDGET, CAP_BUDGET) if length > 32 * K else (LOW_BUDGET,):
                row = headspace_run(model, length, "head", budget, STEPS)
                part.add("head", length, {**row, "prefill_roofline_tok_s": roofline})


def part_long(part: Part) -> None:
    """512K tokens with the GPU capped at 24 GiB: head offload at a 17 GiB budget, then
    layer offload at the cap."""
    part.data["pinned_h2d_bytes_per_s"] = pinned_h2d_bandwidth()
    part.data["compute_rates"] = rates = compute_rates()
    model = random_model(LLAMA3_8B)
    length = 512 * K
    roofline = prefill_roofline_tok_s(length, rates)
    with gpu_cap(CAP_GIB):
        for mode, budget in (("head", LOW_BUDGET), ("layer", CAP_BUDGET)):
            row = headspace_run(model, length, mode, budget, STEPS)
            part.add(mode, length, {**row, "prefill_roofline_tok_s": roofline})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("max", "speed", "long"), required=True)
    parser.add_argument(
        "--reference-512k", action="store_true",
        help="speed part: also the no-offload run at 512K (needs ~90 GiB of GPU memory)",
    )  # fmt: skip
    args = parser.parse_args()
    part = Part(args.part)
    start = time.perf_counter()
    if args.part == "max":
        part_max(part)
    elif args.part == "speed":
        part_speed(part, args.reference_512k)
    else:
        part_long(part)
    part.data["seconds"] = time.perf_counter() - start
    part.path.write_text(json.dumps(part.data, indent=2) + "\n")
    print(f"wrote {part.path} in {part.data['seconds']:.0f} s")


if __name__ == "__main__":
    main()

"""Where the hybrid tier's decode step goes, per layer, across CPU shares, on one engine and
one sequence (decode steps over allocated pages: an exact step's work does not depend on
the values in them, so no prefill is needed).

    PYTHONPATH=src python bench/profiles/profile_hybrid_split.py [--length 131008] [--steps 6]

For each variant (share; the CPU job on the native thread or on a Python worker), at
``--threads`` kernel threads (the engine's ``cpu_threads``), in two rounds of alternating
order: the step's wall time and, summed over its layers, what the thread driving the GPU
does (see ``_breakdown``; recorded by the engine, ``EngineHooks(cpu_timings=...)``). No
engine option picks the share or the native thread per step, so each variant sets them on
the built engine's CPU side (``CpuSplit.share``, ``CpuAttention.background``). Writes
``profile_hybrid_split_<gpu>_<date>.json`` (to $OUT when set).
"""

from __future__ import annotations

import argparse
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
    random_model,
    write_result,
)
from headspace.engine.hooks import EngineHooks  # noqa: E402
from headspace.engine.step_plan import Sequence  # noqa: E402
from headspace.tiers.cpu_timings import CpuTimings  # noqa: E402
from hybrid import BUDGET, CAP_GIB  # noqa: E402
from offload_runs import gpu_cap  # noqa: E402


def _breakdown(timings: CpuTimings) -> dict[str, float]:
    """Milliseconds per step (``timings`` of one step), summed over layers, of the GPU
    thread: launching the layer's GPU part after handing the CPU its job (``launch``),
    waiting for the CPU result (``gpu_waits_cpu``), and from the result to the next layer's
    job (``between``: the merge, the rest of the layer, the next layer up to its query)."""
    jobs = list(zip(timings.submitted, timings.result, timings.collected, strict=True))
    sums = {"launch": 0.0, "gpu_waits_cpu": 0.0, "between": 0.0}
    for i, (submitted, wait, done) in enumerate(jobs):  # perf_counter seconds, seconds
        sums["launch"] += done - wait - submitted
        sums["gpu_waits_cpu"] += wait
        if i + 1 < len(jobs):
            sums["between"] += jobs[i + 1][0] - done
    return {k: 1000 * v for k, v in sums.items()}


def measure(runner, blocks, timings: CpuTimings, seq_id: int, position: int, steps: int) -> dict:
    """``steps`` decode steps of ``seq_id`` from ``position``: each step's wall milliseconds
    and their median, and the median of each part of :func:`_breakdown` over the steps whose
    CPU side ran jobs."""
    times, parts, pages = [], [], blocks.pages([seq_id])
    for step in range(steps):
        blocks.append_token(seq_id)
        torch.cuda.synchronize()
        timings.clear()
        start = time.perf_counter()
        runner.decode([seq_id], [position + step], [0], pages)
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
        if timings.submitted:
            parts.append(_breakdown(timings))
    row = {"step_ms": times, "median_ms": statistics.median(times)}
    if parts:
        row |= {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=128 * 1024 - 64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--shares", type=float, nargs="+", default=[1.0, 0.6, 0.5, 0.4, 0.3, 0.0])
    parser.add_argument("--threads", type=int, default=15, help="cpu_threads")
    args = parser.parse_args()
    model = random_model(LLAMA31_8B)
    timings = CpuTimings()
    result = {"env": environment(), "config": LLAMA31_8B, "length": args.length, "rows": []}
    with gpu_cap(CAP_GIB):
        engine = make_engine(model, EngineHooks(cpu_timings=timings), gpu_memory=BUDGET,
                             offload="hybrid", cpu_threads=args.threads,
                             max_context=args.length + 256)  # fmt: skip
        seq = Sequence(10**9, [0] * args.length, args.length + 256)
        plan, lane = engine.lanes.prepare([seq])
        runner, tiers, blocks = lane.runner, lane.scheduler.tiers, lane.scheduler.blocks
        blocks.allocate_prompt(seq.seq_id, seq.prompt_ids, tiers, reuse=False)
        result["head_map_summary"] = plan.head_map.summary()
        result["staging"] = plan.to_dict()["staging_depth"], plan.staging.piece_pages
        split = runner.tiers[-1].cpu
        position = args.length
        measure(runner, blocks, timings, seq.seq_id, position, 2)  # warm-up: compiles, pins
        position += 2
        native = split.attention.background
        variants = [(s, True) for s in args.shares] + [(s, False) for s in (1.0, 0.5)]
        for round_ in range(2):
            for share, background in variants[:: 1 if round_ == 0 else -1]:
                split.share = share
                split.attention.background = native if background else None
                row = measure(runner, blocks, timings, seq.seq_id, position, args.steps)
                position += args.steps
                row |= {"share": share, "threads": args.threads, "native": background,
                        "round": round_}  # fmt: skip
                result["rows"].append(row)
                print({k: (round(v, 1) if isinstance(v, float) else v)
                       for k, v in row.items() if k != "step_ms"}, flush=True)  # fmt: skip
    gpu = gpu_tag(result["env"])
    write_result(f"profile_hybrid_split_{gpu}_{result['env']['date']}.json", result)
    print(f"\n{'share':>5} {'thr':>3} {'native':>6} {'round':>5} {'step':>6} {'launch':>6} "
          f"{'gpu wait':>8} {'between':>8}")  # fmt: skip
    for row in result["rows"]:
        print(f"{row['share']:>5} {row['threads']:>3} {row['native']!s:>6} {row['round']:>5} "
              f"{row['median_ms']:>6.1f} {row.get('launch', 0):>6.1f} "
              f"{row.get('gpu_waits_cpu', 0):>8.1f} {row.get('between', 0):>8.1f}")  # fmt: skip


if __name__ == "__main__":
    main()

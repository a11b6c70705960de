"""Where a prefill spends its GPU time (Llama-3.1-8B architecture, random bf16 weights):
by default DuoAttention's split, half the heads ``streaming(4,1024)`` and half under
Ada-SnapKV at 0.25 (``--scenarios`` takes the multi-GPU benchmark's other scenarios, and
``full``); one prompt of ``--context`` tokens after an untimed one as long; prints the top
kernels by CUDA time (torch.profiler) and the host ops during the GPU's idle stretches, and
writes both to ``profile_prefill_<scenarios>_<gpu>_<date>.json``, each scenario's prefill
beside the first's, measured in one run.

    PYTHONPATH=src python bench/profiles/profile_prefill.py [--context 65536] [--scenarios duo ...]
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
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
from headspace.engine.sampling import SamplingParams  # noqa: E402
from multigpu import SCENARIOS, make_profile  # noqa: E402
from multigpu_batch import prompt  # noqa: E402


def idle_gaps(prof, min_us: float = 200.0) -> dict:
    """The GPU's idle stretches between kernels longer than ``min_us``: their count and
    total ms, and the host ops running during them by overlapped ms (nested ops each count),
    the top 20: what the GPU waited for."""
    from bisect import bisect_right
    from collections import Counter

    from torch.autograd import DeviceType

    events = prof.events()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == DeviceType.CUDA)  # fmt: skip
    gaps, busy_until = [], kernels[0][1]
    for start, end in kernels[1:]:
        if start - busy_until > min_us:
            gaps.append((busy_until, start))
        busy_until = max(busy_until, end)
    starts, overlap = [g[0] for g in gaps], Counter()
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        first = max(bisect_right(starts, e.time_range.start) - 1, 0)
        for gap_start, gap_end in gaps[first:]:
            if gap_start >= e.time_range.end:
                break
            shared = min(e.time_range.end, gap_end) - max(e.time_range.start, gap_start)
            if shared > 0:
                overlap[e.name] += shared / 1000
    return {"num_gaps": len(gaps), "idle_ms": sum(b - a for a, b in gaps) / 1000,
            "host_ops_ms": overlap.most_common(20)}  # fmt: skip


def profiled_prefill(scenario: str, context: int) -> dict:
    """One scenario's engine (default options plus the scenario's), its prefill of a
    ``context``-token prompt under torch.profiler after an untimed one as long."""
    options = SCENARIOS.get(scenario, {})
    if options:
        profile = Path(tempfile.mkdtemp()) / "profile.json"
        make_profile(LLAMA31_8B, scenario, context, profile)
        options = {**options, "profile": str(profile)}
    engine = make_engine(random_model(LLAMA31_8B), **options)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    engine.generate_batch(
        [prompt(LLAMA31_8B, context - 2, seed=4)], [params]
    )  # compiles its shapes
    ids = prompt(LLAMA31_8B, context - 2, seed=3)
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        (output,) = engine.generate_batch([ids], [params])
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    gaps = idle_gaps(prof)
    print(f"GPU idle: {gaps['idle_ms']:.0f} ms in {gaps['num_gaps']} gaps; host ops meanwhile:")
    for name, ms in gaps["host_ops_ms"]:
        print(f"  {ms:9.1f} ms  {name[:80]}")
    rows = [
        {"name": e.key, "cuda_ms": e.device_time_total / 1000, "calls": e.count}
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:40]
    ]
    head_map = ran_view(engine).layout
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    seconds = output.stats.prefill_seconds
    return {"options": options, "head_map": head_map, "prefill_seconds": seconds,
            "kernels": rows, "idle": gaps}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--scenarios", nargs="+", default=["duo"], choices=("full", *SCENARIOS),
                        help="each in turn; the first is the others' comparison")  # fmt: skip
    args = parser.parse_args()
    runs = {scenario: profiled_prefill(scenario, args.context) for scenario in args.scenarios}
    first = runs[args.scenarios[0]]["prefill_seconds"]
    for run in runs.values():
        run["prefill_vs_first"] = run["prefill_seconds"] / first
    env = environment()
    name = "-".join(args.scenarios)
    write_result(f"profile_prefill_{name}_{gpu_tag(env)}_{env['date']}.json",
                 {"environment": env, "context": args.context, "runs": runs})  # fmt: skip
    for scenario, run in runs.items():
        idle = run["idle"]["idle_ms"]
        print(f"{scenario:>12} prefill {run['prefill_seconds']:.2f} s "
              f"({run['prefill_vs_first']:.3f}x the first), GPU idle {idle:.0f} ms")  # fmt: skip


if __name__ == "__main__":
    main()

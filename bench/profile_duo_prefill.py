"""Where a DuoAttention-style prefill spends its GPU time (Llama-3.1-8B architecture, random
bf16 weights): half the heads ``streaming(4,1024)``, half under Ada-SnapKV at 0.25, one
prompt of ``--context`` tokens after an untimed one as long; prints the top kernels by CUDA
time (torch.profiler) and the host ops during the GPU's idle stretches, and writes both to
``profile_duo_prefill_<gpu>_<date>.json``.

    PYTHONPATH=src python bench/profile_duo_prefill.py [--context 65536]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import LLAMA31_8B, environment, gpu_tag, make_engine, random_model, write_result  # noqa: E402
from headspace.engine.sampling import SamplingParams  # noqa: E402
from multigpu import SCENARIOS, _prompt, make_profile  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=65536)
    args = parser.parse_args()
    profile = Path("/tmp/duo_profile.json")
    make_profile("duo", args.context, profile)
    engine = make_engine(random_model(LLAMA31_8B), profile=str(profile), **SCENARIOS["duo"])
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    engine.generate_batch([_prompt(args.context - 2, seed=4)], [params])  # compiles its shapes
    ids = _prompt(args.context - 2, seed=3)
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        (output,) = engine.generate_batch([ids], [params])
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(table)
    gaps = idle_gaps(prof)
    print(f"GPU idle: {gaps['idle_ms']:.0f} ms in {gaps['num_gaps']} gaps; host ops meanwhile:")
    for name, ms in gaps["host_ops_ms"]:
        print(f"  {ms:9.1f} ms  {name[:80]}")
    rows = [
        {"name": e.key, "cuda_ms": e.device_time_total / 1000, "calls": e.count}
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:40]
    ]
    env = environment()
    write_result(f"profile_duo_prefill_{gpu_tag(env)}_{env['date']}.json",
                 {"environment": env, "context": args.context, "options": SCENARIOS["duo"],
                  "prefill_seconds": output.stats.prefill_seconds, "kernels": rows,
                  "idle": gaps})  # fmt: skip


if __name__ == "__main__":
    main()

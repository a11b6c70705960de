"""Where a hybrid decode step's time goes: each CPU kernel call (its GB/s), the worker's wait
for the query, and the GPU thread's wait for the CPU result, at 128K with ``cpu_share`` 1.

    PYTHONPATH=src python bench/profiles/profile_hybrid.py [--share 1.0] [--sparse BETA]
        [--tokens N]

The engine records them itself (``EngineHooks(cpu_timings=CpuTimings())``). The exact mode's
kernel runs as native jobs, out of Python's sight: only their bytes and the GPU thread's
waits are shown; the sparse mode's runs on the Python worker, each call timed. With
``--sparse`` it also prints each decode step's time: the first steps attend densely (and
write the weights), the later ones only the kept tokens; ``--no-track`` leaves the GPU side's
moving averages out (``CpuTimings.track_weights``), to show what tracking costs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from common import LLAMA31_8B, make_engine, random_model  # noqa: E402
from headspace.engine.hooks import EngineHooks  # noqa: E402
from headspace.engine.sampling import SamplingParams  # noqa: E402
from headspace.tiers.cpu_timings import CpuTimings  # noqa: E402
from hybrid import BUDGET, CAP_GIB, K, _prompt  # noqa: E402
from offload_runs import gpu_cap  # noqa: E402
from sparsity import timed_decode  # noqa: E402

WAITS = {"query": "query", "result": "result", "sparse tables": "tables",
         "track (host)": "track", "selector begin": "begin"}  # fmt: skip


def _report(timings: CpuTimings, steps: int) -> None:
    """Per decode step: the kernel calls (their time and GB/s) or the native jobs (their
    bytes), then each wait's milliseconds."""
    calls = timings.kernel
    if calls:
        seconds, nbytes = sum(t for t, _ in calls), sum(b for _, b in calls)
        per_call = [b / t / 1e9 for t, b in calls]
        print(f"kernel calls per step {len(calls) / steps:.0f}, kernel time per step "
              f"{1000 * seconds / steps:.1f} ms ({nbytes / seconds / 1e9:.1f} GB/s; per call "
              f"median {statistics.median(per_call):.1f}, min {min(per_call):.1f})")  # fmt: skip
    if timings.jobs:
        print(f"native jobs per step {len(timings.jobs) / steps:.0f}, "
              f"{sum(timings.jobs) / steps / 1e9:.2f} GB of K/V per step")  # fmt: skip
    for name, field in WAITS.items():
        waits = getattr(timings, field)
        print(f"wait for the {name}: {1000 * sum(waits) / steps:.1f} ms per step "
              f"({len(waits) / steps:.0f} waits)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--share", type=float, default=1.0)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--sparse", type=float, default=None, help="cpu_sparsity (beta)")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--no-track", action="store_true",
                        help="sparse: skip the GPU side's moving averages")  # fmt: skip
    args = parser.parse_args()
    timings = CpuTimings(track_weights=not args.no_track)
    model = random_model(LLAMA31_8B)
    options = {"cpu_share": args.share, "cpu_threads": args.threads}
    if args.sparse is not None:
        options = {"cpu_sparsity": args.sparse, "cpu_threads": args.threads}
    with gpu_cap(CAP_GIB):
        engine = make_engine(model, EngineHooks(cpu_timings=timings), gpu_memory=BUDGET,
                             offload="hybrid", **options)  # fmt: skip
        params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
        engine.generate_batch([_prompt(128 * K - 64, 0)], [SamplingParams(max_new_tokens=4)])
        timings.clear()  # the warm-up's
        steps_s = timed_decode(engine)
        out = engine.generate_batch([_prompt(128 * K - 64, 1)], [params])[0]
    print("step ms:", " ".join(f"{1000 * t:.0f}" for t in steps_s))
    if out.stats.cpu_kept_fraction:
        print("kept per head min/median/max:", out.stats.cpu_kept_fraction)
    steps = len(out.token_ids) - 1
    print(out.stats.summary())
    print(f"decode {1000 * out.stats.decode_seconds / steps:.1f} ms/token")
    _report(timings, steps)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

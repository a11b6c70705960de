"""Where a decode step's time goes with every head full, under ``kv_budget=0.25`` and with
half the heads streaming (Llama-3.1-8B architecture, random bf16 weights): the GPU kernels
of a few decode steps by total time, from torch.profiler, and the step's wall time.

    PYTHONPATH=src python bench/profiles/profile_entry_decode.py [--context 32768]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, str(Path(__file__).parent.parent))
from common import LLAMA31_8B, make_engine, pinned_h2d_bandwidth, ran_lane, random_model  # noqa: E402
from headspace.engine.sampling import SamplingParams  # noqa: E402
from sparsity import (  # noqa: E402
    MODES,
    OFFLOAD_GPU_MEMORY,
    _ids,
    random_profile,
    streamed_bytes,
    timed_decode,
)

# the sparsity benchmark's modes, and DuoAttention's split (bench/multigpu.py's default)
PROFILED = {
    **MODES,
    "duo": {
        "kv_budget": 0.25,
        "kv_policy": "ada_snapkv",
        "retrieval_heads": 0.5,
        "sparse_pattern": "streaming(4,1024)",
    },
}


def kernel_table(
    engine, prompt: list[int], steps: int, ops: bool = False
) -> tuple[list[tuple[str, float]], float, float]:
    """(the top kernels as (name, us per step), median step ms, all kernels' us per step)
    over the decode steps after the first three (the profiler records only those: its
    schedule advances once per step). ``ops`` also prints the torch ops that launched the
    most GPU time, with the Python lines that called them."""
    params = [SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)]
    times = timed_decode(engine)
    runner, active = ran_lane(engine).runner, steps - 4
    plan = schedule(wait=2, warmup=1, active=active, repeat=1)
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if ops else [])
    with profile(activities=activities, schedule=plan, with_stack=ops) as prof:

        def profiled(seq_ids, step):
            result = step()
            prof.step()
            return result

        runner.decode_hooks.append(profiled)
        engine.generate_batch([prompt], params)
    runner.decode_hooks.clear()  # the timer and the profiler
    decode = sorted(times)[len(times) // 2] * 1000
    if ops:
        table = prof.key_averages(group_by_stack_n=5)
        print(table.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows = [(e.key[:70], e.device_time_total / active) for e in kernels]
    busy = sum(e.self_device_time_total for e in kernels) / active
    return sorted(rows, key=lambda r: -r[1])[:12], decode, busy


def host_busy(engine, prompt: list[int], steps: int,
              host: cProfile.Profile | None = None) -> tuple[float, float]:  # fmt: skip
    """(ms per decode step, of which ms the host waited for the GPU: its tokens, the copy
    of a graph's inputs) over steps run as the engine runs them (not synchronised): the
    rest is the host's own work per step, which bounds the step when the GPU's part is
    shorter. ``host`` profiles the Python of those steps (from the first token read on)."""
    params = [SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)]
    waited, synchronize = [], torch.cuda.Event.synchronize

    def timed(event):
        start = time.perf_counter()
        synchronize(event)
        waited.append(time.perf_counter() - start)
        if host is not None and len(waited) == 1:  # the prompt's token: decode from here
            host.enable()

    torch.cuda.Event.synchronize = timed
    try:
        output = engine.generate_batch([prompt], params)[0]
    finally:
        torch.cuda.Event.synchronize = synchronize
        if host is not None:
            host.disable()
    decode_ms = output.stats.decode_seconds * 1000 / steps
    return decode_ms, sum(waited[1:]) * 1000 / steps  # the first wait: the prompt's token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--modes", nargs="+", default=["full", "snapkv 0.25", "streaming 0.5"],
                        choices=tuple(PROFILED), help="modes profiled, in order")  # fmt: skip
    parser.add_argument("--eager", action="store_true",
                        help="decode without CUDA graphs (the profiler sees kernels in graphs "
                        "only on some drivers)")  # fmt: skip
    parser.add_argument(
        "--gpu-memory",
        default=None,
        help="the engine's GPU budget (default: the mode's, else the GPU's)",
    )
    parser.add_argument("--ops", action="store_true",
                        help="also the torch ops that launched the most GPU time, with their "
                        "callers")  # fmt: skip
    parser.add_argument("--host", action="store_true",
                        help="also the unsynchronised steps' Python functions by own time "
                        "(cProfile)")  # fmt: skip
    args = parser.parse_args()
    model, profile_path = random_model(LLAMA31_8B), random_profile()
    prompt = _ids(args.context - args.steps, 2)
    for mode in args.modes:
        options = PROFILED[mode]
        options = {**options, **({"profile": profile_path} if "retrieval_heads" in options else {})}
        if options.get("offload") == "head":  # the GPU budget bench/sparsity.py gives
            options["gpu_memory"] = OFFLOAD_GPU_MEMORY.get(args.context, "24GiB")
        if args.gpu_memory is not None:
            options["gpu_memory"] = args.gpu_memory
        engine = make_engine(model, **options, **({"cuda_graph": False} if args.eager else {}))
        warm = [SamplingParams(max_new_tokens=args.steps, ignore_eos=True)]
        engine.generate_batch([_ids(args.context - args.steps, 1)], warm)
        rows, decode_ms, busy_us = kernel_table(engine, prompt, args.steps, args.ops)
        print(
            f"{mode}: median step {decode_ms:.2f} ms, kernels {busy_us / 1000:.2f} ms; "
            f"top kernels (us per step):"
        )
        for name, us in rows:
            print(f"  {us:9.1f}  {name}")
        if options.get("offload"):  # the step's floor: its streamed bytes at pinned PCIe speed
            num_bytes = streamed_bytes(engine, args.context)
            floor_ms = 1000 * num_bytes / pinned_h2d_bandwidth()
            print(f"{mode}: {num_bytes / 1e9:.2f} GB streamed a step, PCIe floor {floor_ms:.2f} ms")
        host = cProfile.Profile() if args.host else None
        step_ms, wait_ms = host_busy(engine, prompt, args.steps, host)
        print(f"{mode}: unsynchronised step {step_ms:.2f} ms, the host waited "
              f"{wait_ms:.2f} ms of it for the GPU (its own work "
              f"{step_ms - wait_ms:.2f} ms)")  # fmt: skip
        if host is not None:
            pstats.Stats(host).sort_stats("tottime").print_stats(16)
        del engine
        gc.collect()  # the timing wrappers hold the runner in a cycle
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

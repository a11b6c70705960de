"""Where a decode step's time goes with every head full, under ``kv_budget=0.25`` and with
half the heads streaming (Llama-3.1-8B architecture, random bf16 weights): the GPU kernels
of a few decode steps by total time, from torch.profiler, and the step's wall time.

    PYTHONPATH=src python bench/profile_entry_decode.py [--context 32768]
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from common import LLAMA31_8B, make_engine, random_model  # noqa: E402
from headspace.engine.sampling import SamplingParams  # noqa: E402
from sparsity import MODES, _ids, random_profile, timed_decode  # noqa: E402

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


def kernel_table(engine, prompt: list[int], steps: int) -> tuple[list[tuple[str, float]], float]:
    """(the top kernels as (name, us per step), median step ms) over decode steps 2 to
    ``steps`` (the profiler runs only while they do)."""
    params = [SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)]
    times = timed_decode(engine)
    runner = engine.batch.runner
    step, prof = runner.decode, profile(activities=[ProfilerActivity.CUDA])

    def profiled(*args, **options):
        if len(times) == 1:
            prof.start()
        result = step(*args, **options)
        if len(times) == steps:
            prof.stop()
        return result

    runner.decode = profiled
    engine.generate_batch([prompt], params)
    decode = sorted(times)[len(times) // 2] * 1000
    rows = [(e.key[:70], e.device_time_total / (steps - 1)) for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r[1])[:8], decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--modes", nargs="+", default=["full", "snapkv 0.25", "streaming 0.5"],
                        choices=tuple(PROFILED), help="modes profiled, in order")  # fmt: skip
    parser.add_argument("--eager", action="store_true",
                        help="decode without CUDA graphs (the profiler sees kernels in graphs "
                        "only on some drivers)")  # fmt: skip
    args = parser.parse_args()
    model, profile_path = random_model(LLAMA31_8B), random_profile()
    prompt = _ids(args.context - args.steps, 2)
    for mode in args.modes:
        options = PROFILED[mode]
        options = {**options, **({"profile": profile_path} if "retrieval_heads" in options else {})}
        engine = make_engine(model, **options, **({"cuda_graph": False} if args.eager else {}))
        warm = [SamplingParams(max_new_tokens=args.steps, ignore_eos=True)]
        engine.generate_batch([_ids(args.context - args.steps, 1)], warm)
        rows, decode_ms = kernel_table(engine, prompt, args.steps)
        print(f"{mode}: median step {decode_ms:.2f} ms; kernels (us per step):")
        for name, us in rows:
            print(f"  {us:9.1f}  {name}")
        del engine
        gc.collect()  # the timing wrappers hold the runner in a cycle
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Where a mixed step's time goes: a prompt piece and the decode rows in one forward
(``mixed_steps``) against two forwards (the piece, then the graphed decode step), on
Llama-3.1-8B's shapes with random bf16 weights.

    PYTHONPATH=src python bench/profiles/profile_mixed_step.py

Eight requests of 2K tokens decode; two prompts of 6K arrive. For each way, ten steps of
the prefill beside the decode rows: wall milliseconds a step (synchronised), kernel
milliseconds a step (the profiler's device time) and prompt tokens a step. Wall well past
the kernels' time: the step waits for the host's launches.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent.parent))
from common import LLAMA31_8B, make_engine, random_model  # noqa: E402
from headspace import SamplingParams  # noqa: E402

STEPS = 10
VARIANTS = {  # name: engine options
    "one forward": {"mixed_steps": True},
    "one, cap 1.5": {"mixed_steps": True, "prefill_slowdown": 1.5},
    "two forwards": {},
}


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, 100000, (length,), generator=generator).tolist()
            for _ in range(count)]  # fmt: skip


def steps_beside_decoding(engine) -> dict:
    """Ten steps of two 6K prompts' prefill beside eight decoding requests."""
    params = SamplingParams(max_new_tokens=400, ignore_eos=True)
    running = [engine.add_request(p, params) for p in prompts(8, 2048, 1)]
    while not all(engine.load().request(r).generated_tokens for r in running):
        engine.step()
    for prompt in prompts(2, 6144, 2):
        engine.add_request(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    for _ in range(3):  # (their first pieces: compiles, if any)
        engine.step()
    lane = engine.lanes.resident
    walls, tokens = [], 0.0
    for _ in range(2):  # (the first window may capture the graphs of new pieces' buckets)
        torch.cuda.synchronize()
        before, started = lane.prefilled_tokens, time.perf_counter()
        for _ in range(STEPS):
            engine.step()
            torch.cuda.synchronize()
        walls.append((time.perf_counter() - started) / STEPS)
        tokens = (lane.prefilled_tokens - before) / STEPS
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sum(e.self_device_time_total for e in events)  # (each kernel once)
    print(events.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
    return {"first_wall_ms": 1e3 * walls[0], "wall_ms": 1e3 * walls[1],
            "kernel_ms": kernels / 1e3 / STEPS, "tokens": tokens}  # fmt: skip


@torch.inference_mode()
def main() -> None:
    model = random_model(LLAMA31_8B)
    rows = {}
    for name, options in VARIANTS.items():
        engine = make_engine(model, gpu_memory="24GiB", **options)
        rows[name] = row = steps_beside_decoding(engine)
        print(f"{name}: {row}", flush=True)
        del engine
        torch.cuda.empty_cache()
    print(f"\n{'step':<14}{'first wall ms':>14}{'wall ms':>9}{'kernel ms':>11}{'prompt tok':>12}")
    for name, row in rows.items():
        print(f"{name:<14}{row['first_wall_ms']:>14.1f}{row['wall_ms']:>9.1f}"
              f"{row['kernel_ms']:>11.1f}{row['tokens']:>12.0f}")  # fmt: skip


if __name__ == "__main__":
    main()

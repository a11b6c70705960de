"""What one LSE merge of two attention states costs, torch's operations against the Triton
kernel, at the shapes the offload lane merges: the host's time a call (what a thread that
launches a decode step's layers one by one pays) and the GPU's.

    PYTHONPATH=src python bench/profiles/merge_cost.py [--calls 2000]

Shapes (Llama-3.1-8B: 32 query heads of 128 dims, 4 a kv head):
- ``decode_hybrid``: a layer's GPU part (bf16, ``[seqs, heads, dim]`` seen transposed) and
  the CPU's part (fp32) of one sequence, into the GPU part in place (the hybrid tier);
- ``decode_batch8``: the same for 8 sequences;
- ``prefill_piece``: one kv head's 4 query heads over a 2,048-token piece, fp32, into a
  slice of the running state (the stream tier's prompt pieces).

For each, ``host_us`` is the host's time a call (the median of rounds of 40 calls queued
behind a kernel that keeps the GPU busy, so that only the launches are timed) and ``gpu_us``
the GPU's (CUDA events over ``--calls`` calls back to back), for ``torch`` and ``kernel``. Writes
``merge_cost_<gpu>_<date>.json`` (to $OUT when set).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from common import environment, gpu_tag, write_result  # noqa: E402
from headspace.attention.merge import _merged  # noqa: E402
from headspace.attention.merge_kernel import merge_pair  # noqa: E402

HEADS, DIM = 32, 128
# calls timed on the host at a time: their kernels (about 15 a torch merge) must stay under
# the launch queue's depth (about 1,000), or the host waits for the GPU
HOST_CALLS, HOST_ROUNDS = 40, 9


def _states(shape: str, device: str):
    """(a_out, a_lse, b_out, b_lse, out, lse_out) of one shape."""
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*size, dtype=torch.float32):
        return torch.randn(*size, generator=generator, device=device).to(dtype)

    if shape.startswith("decode"):
        seqs = 8 if shape.endswith("batch8") else 1
        gpu = randn(seqs, HEADS, DIM, dtype=torch.bfloat16)
        cpu = randn(seqs, HEADS, DIM)
        a_lse, b_lse = randn(HEADS, seqs), randn(seqs, HEADS).t()
        return gpu.transpose(0, 1), a_lse, cpu.transpose(0, 1), b_lse, gpu.transpose(0, 1), None
    state, lse = randn(HEADS, 2048, DIM), randn(HEADS, 2048)
    part, part_lse = randn(4, 2048, DIM), randn(4, 2048)
    rows = slice(8, 12)
    return state[rows], lse[rows], part, part_lse, state[rows], lse[rows]


def _torch_merge(a_out, a_lse, b_out, b_lse, out, lse_out):
    merged, lse = _merged([a_out, b_out], [a_lse, b_lse])
    out.copy_(merged)
    if lse_out is not None:
        lse_out.copy_(lse)


def _kernel_merge(a_out, a_lse, b_out, b_lse, out, lse_out):
    merge_pair(a_out, a_lse, b_out, b_lse, out, lse_out)


def measure(fn, states, calls: int) -> dict:
    for _ in range(20):
        fn(*states)
    hosts = []
    for _ in range(HOST_ROUNDS):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))  # (the GPU busy past the host's loop: launches only)
        started = time.perf_counter()
        for _ in range(HOST_CALLS):
            fn(*states)
        hosts.append((time.perf_counter() - started) / HOST_CALLS)
    host = sorted(hosts)[HOST_ROUNDS // 2]
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn(*states)
    end.record()
    torch.cuda.synchronize()
    return {"host_us": host * 1e6, "gpu_us": begin.elapsed_time(end) * 1e3 / calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    rows = {}
    for shape in ("decode_hybrid", "decode_batch8", "prefill_piece"):
        states = _states(shape, "cuda")
        ways = (("torch", _torch_merge), ("kernel", _kernel_merge))
        rows[shape] = {name: measure(fn, states, args.calls) for name, fn in ways}
    print(f"{'shape':<16}{'torch host us':>15}{'kernel host us':>16}"
          f"{'torch GPU us':>14}{'kernel GPU us':>15}")  # fmt: skip
    for shape, row in rows.items():
        print(f"{shape:<16}{row['torch']['host_us']:>15.1f}{row['kernel']['host_us']:>16.1f}"
              f"{row['torch']['gpu_us']:>14.1f}{row['kernel']['gpu_us']:>15.1f}")  # fmt: skip
    env = environment()
    write_result(f"merge_cost_{gpu_tag(env)}_{env['date']}.json",
                 {"environment": env, "calls": args.calls, "shapes": rows})  # fmt: skip


if __name__ == "__main__":
    main()

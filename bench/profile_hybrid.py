"""Where a hybrid decode step's time goes: each CPU kernel call (its GB/s), the worker's wait
for the query, and the GPU thread's wait for the CPU result, at 128K with ``cpu_share`` 1.

    PYTHONPATH=src python bench/profile_hybrid.py [--share 1.0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import headspace.engine.hybrid as hybrid  # noqa: E402
from common import LLAMA31_8B, make_engine, random_model  # noqa: E402
from headspace.engine.sampling import SamplingParams  # noqa: E402
from hybrid import BUDGET, CAP_GIB, K, _prompt  # noqa: E402
from offload_runs import gpu_cap  # noqa: E402

CALLS: list[tuple[float, int]] = []
WAITS: dict[str, list[float]] = {"query": [], "result": []}


def _instrument() -> None:
    kernel, run, result = (
        hybrid.cpu_paged_decode,
        hybrid.CpuAttention._run,
        hybrid.CpuAttention.result,
    )

    def timed_kernel(q, k, v, tables, ends, page_size, **options):
        start = time.perf_counter()
        out = kernel(q, k, v, tables, ends, page_size, **options)
        nbytes = int(ends.sum()) * k.shape[0] * 2 * k.shape[-1] * k.element_size()
        CALLS.append((time.perf_counter() - start, nbytes))
        return out

    def timed_run(self, q, ready, kv, tables, ends):
        start = time.perf_counter()
        if ready is not None:
            ready.synchronize()
        WAITS["query"].append(time.perf_counter() - start)
        return run(self, q, None, kv, tables, ends)

    def timed_result(job, device):
        start = time.perf_counter()
        job.result()
        WAITS["result"].append(time.perf_counter() - start)
        return result(job, device)

    hybrid.cpu_paged_decode = timed_kernel
    hybrid.CpuAttention._run = timed_run
    hybrid.CpuAttention.result = staticmethod(timed_result)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--share", type=float, default=1.0)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    model = random_model(LLAMA31_8B)
    with gpu_cap(CAP_GIB):
        engine = make_engine(model, gpu_memory=BUDGET, offload="hybrid", cpu_share=args.share,
                             cpu_threads=args.threads)  # fmt: skip
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        engine.generate_batch([_prompt(128 * K - 64, 0)], [params])
        _instrument()
        out = engine.generate_batch([_prompt(128 * K - 64, 1)], [params])[0]
    steps = len(out.token_ids) - 1
    seconds = sum(t for t, _ in CALLS)
    nbytes = sum(b for _, b in CALLS)
    per_call = [b / t / 1e9 for t, b in CALLS]
    print(out.stats.summary())
    print(f"decode {1000 * out.stats.decode_seconds / steps:.1f} ms/token; kernel calls per "
          f"step {len(CALLS) / steps:.0f}, kernel time per step {1000 * seconds / steps:.1f} ms "
          f"({nbytes / seconds / 1e9:.1f} GB/s; per call median "
          f"{statistics.median(per_call):.1f}, min {min(per_call):.1f})")  # fmt: skip
    for name, waits in WAITS.items():
        print(f"wait for the {name}: {1000 * sum(waits) / steps:.1f} ms per step "
              f"({len(waits) / steps:.0f} waits)")  # fmt: skip
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

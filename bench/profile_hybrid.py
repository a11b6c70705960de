"""Where a hybrid decode step's time goes: each CPU kernel call (its GB/s), the worker's wait
for the query, and the GPU thread's wait for the CPU result, at 128K with ``cpu_share`` 1.

    PYTHONPATH=src python bench/profile_hybrid.py [--share 1.0] [--sparse BETA] [--tokens N]

With ``--sparse`` it also prints each decode step's time: the first steps attend densely
(and write the weights), the later ones only the kept tokens.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import headspace.tiers.hybrid as hybrid  # noqa: E402
from common import LLAMA31_8B, make_engine, random_model  # noqa: E402
from headspace.engine.sampling import SamplingParams  # noqa: E402
from headspace.tiers.hybrid_sparse import SparseSelector  # noqa: E402
from hybrid import BUDGET, CAP_GIB, K, _prompt  # noqa: E402
from offload_runs import gpu_cap  # noqa: E402

CALLS: list[tuple[float, int]] = []
WAITS: dict[str, list[float]] = {"query": [], "result": [], "sparse tables": [],
                                 "track (host)": [], "selector begin": []}  # fmt: skip


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

    def timed_run(self, q, ready, layer, kv_range):
        start = time.perf_counter()
        if ready is not None:
            ready.synchronize()
        WAITS["query"].append(time.perf_counter() - start)
        out, lse = run(self, q, None, layer, kv_range)
        return out.pin_memory(), lse.pin_memory()

    def timed_result(self, job, device):
        start = time.perf_counter()
        out = result(self, job, device)
        WAITS["result"].append(time.perf_counter() - start)
        return out

    tables = SparseSelector.token_tables

    track, begin = SparseSelector.track, SparseSelector.begin

    def timed_track(self, *args):
        start = time.perf_counter()
        track(self, *args)
        WAITS["track (host)"].append(time.perf_counter() - start)

    def timed_begin(self, *args):
        start = time.perf_counter()
        begin(self, *args)
        WAITS["selector begin"].append(time.perf_counter() - start)

    SparseSelector.track, SparseSelector.begin = timed_track, timed_begin

    def timed_tables(self, *args):
        start = time.perf_counter()
        out = tables(self, *args)
        WAITS["sparse tables"].append(time.perf_counter() - start)
        return out

    SparseSelector.token_tables = timed_tables
    hybrid.cpu_paged_decode = timed_kernel
    hybrid.CpuAttention._run = timed_run
    hybrid.CpuAttention.result = timed_result


def _time_steps(runner) -> list[float]:
    """Wall milliseconds of each decode step of ``runner`` (synchronised), filled as it runs."""
    times, decode = [], runner.decode

    def timed(*args, **options):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = decode(*args, **options)
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
        return result

    runner.decode = timed
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--share", type=float, default=1.0)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--sparse", type=float, default=None, help="cpu_sparsity (beta)")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--no-track", action="store_true",
                        help="sparse: skip the moving averages' update")  # fmt: skip
    args = parser.parse_args()
    if args.no_track:
        from headspace.tiers.streamed import StreamedTier

        StreamedTier._track = lambda *args: None
    model = random_model(LLAMA31_8B)
    options = {"cpu_share": args.share, "cpu_threads": args.threads}
    if args.sparse is not None:
        options = {"cpu_sparsity": args.sparse, "cpu_threads": args.threads}
    with gpu_cap(CAP_GIB):
        engine = make_engine(model, gpu_memory=BUDGET, offload="hybrid", **options)
        params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
        engine.generate_batch([_prompt(128 * K - 64, 0)], [SamplingParams(max_new_tokens=4)])
        _instrument()
        steps_ms = _time_steps(engine.batch.runner)
        out = engine.generate_batch([_prompt(128 * K - 64, 1)], [params])[0]
    print("step ms:", " ".join(f"{t:.0f}" for t in steps_ms))
    if out.stats.cpu_kept_fraction:
        print("kept per head min/median/max:", out.stats.cpu_kept_fraction)
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

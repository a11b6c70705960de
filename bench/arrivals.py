"""Requests arriving over time: the stepping engine under a Poisson process of prompts of
1K-128K tokens, against the same requests given to ``generate`` at once.

    PYTHONPATH=src python bench/arrivals.py        # on a GPU machine, about six minutes

Llama-3.1-8B's architecture with random bf16 weights, the engine built as a user builds it
(the model's 128K context, default options) under a 24 GiB GPU budget. The requests (fixed
seed): mostly 1K-16K tokens, two of 32K, one of 64K and one of 128K, 64 new tokens each. First the
offline run (``generate_batch`` of all of them) gives the engine's capacity; the arrivals
then come at a rate that keeps it busy (their mean span ``LOAD`` x the offline time), and
the loop adds each request once its arrival time has passed, between steps. Reported:
throughput against offline, time to first token and time per output token per prompt-length
bucket (p50 / p99), the inter-token times of running requests while a prompt of 32K or more
is being prefilled, and peak reserved memory against the budget. ``--step-tokens`` sets
``prefill_step_tokens`` for both runs (a step beside decoding requests carries at most the
work of a prompt's first this many tokens: a resident chunk's layers are spread over
steps; by default the engine's, smaller for requests arriving than for a batch). Writes
``arrivals_llama3-8b_<gpu>_<date>.json`` (to $OUT when set).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
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

K = 1024
BUDGET_GIB = 24
NEW_TOKENS = 64
LOAD = 0.8  # the arrivals' span over the offline run's time: the engine stays busy
BUCKETS = [(0, 4 * K), (4 * K, 16 * K), (16 * K, 64 * K), (64 * K, 129 * K)]
LONG = 32 * K  # a prompt from this length on: running requests' tokens during its prefill


def workload(num_short: int, seed: int = 0) -> list[int]:
    """Prompt lengths in arrival order: log-uniform 1K-16K, and two of 32K, one of 64K and
    one of 128K placed among them."""
    rng = random.Random(seed)
    lengths = [int(2 ** rng.uniform(10, 14)) for _ in range(num_short)]
    for at, length in ((num_short // 5, 32 * K), (2 * num_short // 5, 64 * K),
                       (3 * num_short // 5, 128 * K - 2 * K),
                       (4 * num_short // 5, 32 * K)):  # fmt: skip
        lengths.insert(at, length)
    return lengths


def _prompt(length: int, index: int, vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(1000 + index)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


def run_online(engine, prompts: list[list[int]], arrivals: list[float]) -> dict:
    """Add each prompt once its arrival time (seconds from the start) has passed; step
    until all end. Per request: arrival, token times; the prefill windows of long ones and
    the layouts their steps ran in."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    times: dict[int, list[float]] = {}
    arrived: dict[int, float] = {}
    long_windows, long_id, long_start = [], None, 0.0
    layouts = {"resident": 0, "streamed": 0, "hybrid": 0}  # steps while a long one prefills
    start, next_index = time.perf_counter(), 0
    while next_index < len(prompts) or engine.has_unfinished():
        now = time.perf_counter() - start
        while next_index < len(prompts) and arrivals[next_index] <= now:
            request = engine.add_request(prompts[next_index], params)
            arrived[request] = arrivals[next_index]
            times[request] = []
            next_index += 1
        if not engine.has_unfinished():  # idle until the next arrival
            time.sleep(max(arrivals[next_index] - now, 0))
            continue
        if long_id is not None:
            load = engine.load()
            layout = "hybrid" if load.hybrid_entries else "resident"
            layouts["streamed" if load.streamed_entries else layout] += 1
        outputs = engine.step()
        now = time.perf_counter() - start
        for output in outputs:
            times[output.request_id] += [now] * len(output.new_token_ids)
        prefilling = engine.prefilling()
        if prefilling != long_id:  # a long prompt's prefill began or ended
            if long_id is not None:
                long_windows.append((long_start, now))
            long_id, long_start = None, now
            if prefilling is not None and len(prompts[_index(arrived, prefilling)]) >= LONG:
                long_id = prefilling
    ids = sorted(times)
    return {"arrived": [arrived[i] for i in ids], "times": [times[i] for i in ids],
            "long_windows": long_windows, "long_prefill_layouts": layouts,
            "seconds": time.perf_counter() - start}  # fmt: skip


def _index(arrived: dict[int, float], request_id: int) -> int:
    """The prompt index of ``request_id`` (ids are given in arrival order)."""
    return sorted(arrived).index(request_id)


def _percentiles(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return statistics.median(ordered), p99


def summarise(lengths: list[int], online: dict) -> dict:
    """TTFT and TPOT per bucket; inter-token times overall and during long prefills."""
    ttft = [t[0] - a for t, a in zip(online["times"], online["arrived"], strict=True)]
    gaps = [[b - a for a, b in zip(t, t[1:], strict=False)] for t in online["times"]]
    during = [b - a for t in online["times"] for a, b in zip(t, t[1:], strict=False)
              if any(lo < b and a < hi for lo, hi in online["long_windows"])]  # fmt: skip
    buckets = {}
    for lo, hi in BUCKETS:
        rows = [i for i, n in enumerate(lengths) if lo <= n < hi]
        if rows:
            p50, p99 = _percentiles([ttft[i] for i in rows])
            g50, g99 = _percentiles([g for i in rows for g in gaps[i]])
            buckets[f"{lo // K}K-{hi // K}K"] = {
                "requests": len(rows), "ttft_p50_s": p50, "ttft_p99_s": p99,
                "tpot_p50_ms": 1e3 * g50, "tpot_p99_ms": 1e3 * g99}  # fmt: skip
    all_gaps = [g for row in gaps for g in row]
    ttft50, ttft99 = _percentiles(ttft)
    tpot50, tpot99 = _percentiles(all_gaps)
    _, during99 = _percentiles(during)
    return {"ttft_p50_s": ttft50, "ttft_p99_s": ttft99, "tpot_p50_ms": 1e3 * tpot50,
            "tpot_p99_ms": 1e3 * tpot99, "tpot_p99_ms_during_long_prefill": 1e3 * during99,
            "tokens_during_long_prefill": len(during), "buckets": buckets}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="short requests")
    parser.add_argument("--step-tokens", type=int, default=None,
                        help="prefill_step_tokens (default: the engine's)")  # fmt: skip
    args = parser.parse_args()
    env = environment()
    model = random_model(LLAMA31_8B)
    options = {} if args.step_tokens is None else {"prefill_step_tokens": args.step_tokens}
    engine = make_engine(model, gpu_memory=f"{BUDGET_GIB}GiB", **options)
    lengths = workload(args.requests)
    vocab = model.config.vocab_size
    prompts = [_prompt(n, i, vocab) for i, n in enumerate(lengths)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    warm = time.perf_counter()  # compiles, graphs and cuDNN plans; a streamed layout too
    warm_lengths = lengths[:8] + [LONG]
    engine.generate_batch([_prompt(n, -1 - i, vocab) for i, n in enumerate(warm_lengths)],
                          [SamplingParams(max_new_tokens=8, ignore_eos=True)]
                          * len(warm_lengths))  # fmt: skip
    print(f"warm-up {time.perf_counter() - warm:.1f} s", flush=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    offline = engine.generate_batch(prompts, [params] * len(prompts))
    offline_seconds = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in offline)
    rng = random.Random(1)
    rate = len(prompts) / (LOAD * offline_seconds)  # requests per second
    arrivals, clock = [], 0.0
    for _ in prompts:
        arrivals.append(clock)
        clock += rng.expovariate(rate)
    torch.cuda.reset_peak_memory_stats()
    online = run_online(engine, prompts, arrivals)
    stats = summarise(lengths, online)
    throughput = sum(len(t) for t in online["times"]) / online["seconds"]
    offline_tok_s = generated / offline_seconds
    result = {
        "env": env, "config": LLAMA31_8B, "gpu_memory": f"{BUDGET_GIB}GiB",
        "prefill_step_tokens": engine.config.runtime.step_tokens(at_once=False),
        "prefill_step_tokens_at_once": engine.config.runtime.step_tokens(at_once=True),
        "workload": {"prompt_lengths": lengths, "new_tokens": NEW_TOKENS, "load": LOAD,
                     "arrival_rate_per_s": rate, "arrivals_s": arrivals},
        "head_map": ran_view(engine).layout,
        "throughput_tok_s": throughput, "offline_throughput_tok_s": offline_tok_s,
        "throughput_vs_offline": throughput / offline_tok_s,
        **{k: v for k, v in stats.items() if k != "buckets"},
        "tpot_during_long_prefill_vs_p50": stats["tpot_p99_ms_during_long_prefill"]
        / stats["tpot_p50_ms"],
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "budget_gib": BUDGET_GIB, "buckets": stats["buckets"],
        "online_seconds": online["seconds"], "offline_seconds": offline_seconds,
        "steps_during_long_prefill_by_layout": online["long_prefill_layouts"],
    }  # fmt: skip
    step = "" if args.step_tokens is None else f"_step{args.step_tokens}"
    path = write_result(f"arrivals_llama3-8b_{gpu_tag(env)}{step}_{env['date']}.json", result)
    print(f"\nwrote {path}")
    print(f"{'bucket':<10}{'n':>4}{'ttft p50/p99 s':>18}{'tpot p50/p99 ms':>20}")
    for name, row in stats["buckets"].items():
        print(f"{name:<10}{row['requests']:>4}{row['ttft_p50_s']:>9.2f}{row['ttft_p99_s']:>9.2f}"
              f"{row['tpot_p50_ms']:>10.1f}{row['tpot_p99_ms']:>10.1f}")  # fmt: skip
    print(f"throughput {throughput:.1f} tok/s vs offline {offline_tok_s:.1f} "
          f"({result['throughput_vs_offline']:.2f}x); tpot p99 during long prefill "
          f"{stats['tpot_p99_ms_during_long_prefill']:.1f} ms vs p50 {stats['tpot_p50_ms']:.1f} "
          f"({result['tpot_during_long_prefill_vs_p50']:.2f}x); peak reserved "
          f"{result['peak_reserved_gib']:.2f} GiB of {BUDGET_GIB}")  # fmt: skip


if __name__ == "__main__":
    main()

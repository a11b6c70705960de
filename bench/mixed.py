"""A long request and short ones served side by side, each at its own speed: the short ones
all resident in the resident lane, the long one streaming or CPU-attending heads in the
offload lane.

    PYTHONPATH=src python bench/mixed.py [--scenarios a,b,c]   # a GPU machine, 128 GiB host

Llama-3.1-8B's architecture with random bf16 weights saved as a checkpoint (``bench/serve.py``'s),
served by ``headspace serve --gpu-memory 24GiB --host-memory 100GiB`` and driven by the
``openai`` client (streamed completions; a token's time is its chunk's arrival). Scenarios:

- (a) 4 short streams (1.5K-token prompts, 1,500 new tokens) and a 128K prompt 3 s later;
- (b) 16 short streams (500-token prompts, 500 new tokens) and a 128K prompt 3 s later;
- (c) 4 short streams as in (a) and a 512K prompt 3 s later.

The long request asks for 16 new tokens. Each short stream is a closed loop: when its request
ends it sends another of the same shape (a fresh prompt), until the long request has ended, so
that short tokens fall in the long one's prefill and decode alike. "Alone": the same loops in
the same server with no long request, for as long as the mixed run took; the long request in a
server whose GPU budget is 24 GiB less the short streams' peak KV (the memory the others leave
it, so that it gets the same placement: both are recorded), with no part of the arena kept for
arrivals (``--resident-reserve 0``). Its floor is its placement's: the
offloaded entries' K/V of a step over PCIe at the copy rate measured here, or, with hybrid
heads, split between PCIe and the CPU at the rates measured here (the planner's
``offloaded_seconds``). Every server is warmed up alike: the engine's warm-up, then one request
that runs in the offload lane, aborted after its first tokens. Writes
``mixed_llama3-8b_<gpu>_<date>.json`` (to $OUT when set).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import math
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import LLAMA31_8B, environment, gpu_tag, pinned_h2d_bandwidth, write_result  # noqa: E402
from headspace.planner.memory import Hardware, offloaded_seconds  # noqa: E402
from serve import NAME, percentiles, save_checkpoint, scrape, start_server  # noqa: E402

K, GiB = 1024, 2**30
BUDGET_GIB, HOST = 24, "100GiB"
MAX_CONTEXT = 512 * K
LONG_NEW = 16
SCENARIOS = {  # name: (short streams, short prompt, short new tokens, long prompt)
    "a": (4, 1536, 1500, 128 * K - 256),
    "b": (16, 512, 500, 128 * K - 256),
    "c": (4, 1536, 1500, 512 * K - 1024),
}
LONG_AFTER_S = 3.0
SPY_SECONDS = 30  # --profile: the long request of (a) or (b), its prefill and decode
MAX_CONCURRENT = 32  # (the servers' bound: scenario b's 17 requests; warm-up to its bucket)
ENTRY_KEYS = ("resident", "streamed", "hybrid")
KEYS = ("short_tpot_p50_ms", "short_tpot_p99_ms", "short_tpot_p50_ms_alone",
        "short_tpot_p99_ms_during_long_prefill", "short_tpot_p99_ms_during_long_decode",
        "long_ttft_s", "long_ttft_s_alone", "long_decode_ms", "long_decode_ms_alone",
        "long_decode_floor_ms", "peak_reserved_gib", "budget_gib", "num_failed")  # fmt: skip


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def stream(client, prompt: list[int], new: int, delay: float = 0.0) -> dict:
    """One streamed completion after ``delay`` s: when it was sent, each token's arrival
    (perf_counter seconds), or its error."""
    await asyncio.sleep(delay)
    sent, times = time.perf_counter(), []
    try:
        chunks = await client.completions.create(
            model=NAME, prompt=prompt, max_tokens=new, temperature=0, stream=True,
            extra_body={"ignore_eos": True})  # fmt: skip
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].text:
                times.append(time.perf_counter())
    except Exception as error:  # noqa: BLE001 (counted as a failure)
        return {"error": repr(error), "sent": sent, "times": times}
    return {"sent": sent, "times": times}


def _import_client() -> None:
    import openai  # noqa: F401 (in the long request's process, before its clock runs)


def stream_apart(url: str, prompt: list[int], new: int, delay: float) -> dict:
    """:func:`stream` in this process with a client of its own. The long request goes from a
    process apart from the short streams' readers: the openai client turns a 130K-token
    prompt into its request body in Python, 1.2-1.5 s in which one event loop would read no
    short stream's tokens (every short stream showed a gap that long from the moment the
    long prompt was sent, while the server's resident lane kept its step rate:
    bench/NOTES.md). Times are ``perf_counter``'s, one clock for every process on Linux."""
    from openai import AsyncOpenAI

    async def run() -> dict:
        client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
        try:
            return await stream(client, prompt, new, delay)
        finally:
            await client.close()

    return asyncio.run(run())


async def warm(url: str) -> None:
    """One request that runs in the offload lane (its prompt and new tokens past what the
    arena holds resident), closed after its first tokens."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    chunks = await client.completions.create(model=NAME, prompt=ids(4 * K, 7),
                                             max_tokens=120 * K, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})  # fmt: skip
    seen = 0
    async for chunk in chunks:
        seen += bool(chunk.choices and chunk.choices[0].text)
        if seen >= 4:
            break
    await chunks.close()
    await client.close()
    await asyncio.sleep(2.0)  # its pages back, the arena joined again


def _entries(url: str) -> dict[str, float]:
    return {tier: scrape(url, f'headspace_head_entries{{model_name="{NAME}",tier="{tier}"}}')
            for tier in ENTRY_KEYS}  # fmt: skip


COMPILE_SERIES = f'headspace_compile_seconds_total{{model_name="{NAME}"}}'
LANE_SERIES = ("headspace_lane_steps_total", "headspace_lane_prefill_tokens_total",
               "headspace_lane_requests")  # fmt: skip


def lane_sample(url: str) -> dict[str, float]:
    """The lanes' series of /metrics now, by their labels past the model's ("lane=offload",
    "lane=resident,state=decoding", ...); zeros left out."""
    import httpx

    sample = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, rest = line.partition("{")
        if name in LANE_SERIES and not line.endswith(" 0.0"):
            labels = dict(label.split("=") for label in rest.split("}")[0].split(","))
            shown = [labels[k].strip('"') for k in ("lane", "state") if k in labels]
            key = name.removeprefix("headspace_lane_").removesuffix("_total")
            sample[key + ":" + ",".join(shown)] = float(line.rsplit(" ", 1)[1])
    return sample


async def short_loop(client, seed: int, prompt_len: int, new: int, going) -> list[dict]:
    """One short stream: a request of ``prompt_len`` tokens asking for ``new`` ones, then
    another with a fresh prompt (seeded from ``seed``), while ``going()`` holds (at least
    one)."""
    results, turn = [], 0
    while turn == 0 or going():
        prompt = ids(prompt_len, seed + 1000 * turn)
        results.append(await stream(client, prompt, new))
        turn += 1
    return results


async def drive(url: str, shorts: tuple[int, int, int], long_prompt: list[int] | None,
                seconds: float, seed: int, on_long=None) -> dict:  # fmt: skip
    """``shorts`` = (streams, prompt tokens, new tokens), each a closed loop while the long
    request runs (sent ``LONG_AFTER_S`` in), or for ``seconds`` without one; while the long
    one runs, the head map in force (the offload lane's) is read from /metrics. ``on_long``:
    called half a second before the long request is sent."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    count, prompt_len, new = shorts
    start, long_task, entries, timeline = time.perf_counter(), None, {}, []
    if long_prompt is not None:  # sent from a process of its own (see stream_apart)
        apart = concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
        apart.submit(_import_client).result()  # (its imports done before the clock runs)
        start = time.perf_counter()
        long_task = asyncio.get_running_loop().run_in_executor(
            apart, stream_apart, url, long_prompt, LONG_NEW, LONG_AFTER_S
        )
        if on_long is not None:
            asyncio.get_running_loop().call_later(max(0.0, LONG_AFTER_S - 0.5), on_long)

    def going() -> bool:
        if long_task is not None:
            return not long_task.done()
        return time.perf_counter() - start < seconds

    tasks = [asyncio.ensure_future(short_loop(client, seed + i, prompt_len, new, going))
             for i in range(count)]  # fmt: skip
    while long_task is not None and not long_task.done():
        await asyncio.sleep(1.0)
        seen = await asyncio.to_thread(_entries, url)
        if seen["streamed"] + seen["hybrid"] > 0:
            entries = seen
        lanes = await asyncio.to_thread(lane_sample, url)
        compiled = await asyncio.to_thread(scrape, url, COMPILE_SERIES)  # (the server's so far)
        timeline.append({"t": round(time.perf_counter() - start, 2), **lanes,
                         "compile_s": round(compiled, 2)})  # fmt: skip
    results = [r for loop in await asyncio.gather(*tasks) for r in loop]
    long = None
    if long_task is not None:
        try:
            long = await long_task
        except Exception as error:  # noqa: BLE001 (its process failed: counted as a failure)
            long = {"error": repr(error), "sent": start + LONG_AFTER_S, "times": []}
        finally:
            apart.shutdown()
    await client.close()
    return {"shorts": results, "long": long, "entries": entries, "timeline": timeline,
            "seconds": time.perf_counter() - start}  # fmt: skip


def gaps(results: list[dict]) -> list[tuple[float, float]]:
    """(seconds between two tokens of one short stream, when the second came)."""
    return [(b - a, b) for r in results for a, b in zip(r["times"], r["times"][1:], strict=False)]


def serve_run(model_dir: Path, budget_gib: float, jobs: list, *flags: str,
              profile: Path | None = None) -> list[dict]:  # fmt: skip
    """Start a server under ``budget_gib`` (and ``flags``), warm it, run each ``(shorts,
    long, seconds)`` of ``jobs`` in turn (``seconds``: a number, or the previous run's length
    when None); each run's results with the server's peak reserved GiB so far, and at ready
    (after the server's warm-up, before this bench's first request). ``profile``:
    where py-spy writes the server's threads from just before the first long request on."""
    server, url = start_server(model_dir, "--max-context", str(MAX_CONTEXT), "--host-memory",
                               HOST, "--max-concurrent-requests", str(MAX_CONCURRENT), *flags,
                               budget=f"{budget_gib:.3f}GiB")  # fmt: skip
    runs, spies, spied = [], [], []

    def spy() -> None:
        if profile is not None and not spied:
            spied.append(True)
            spies.extend(record_threads(server.pid, SPY_SECONDS, profile))

    try:
        # (the server's warm-up's own peak apart: its offload lane's lays out the whole context)
        ready_peak_gib = scrape(url, "headspace_gpu_peak_reserved_bytes") / GiB
        asyncio.run(warm(url))
        for shorts, long_prompt, seconds in jobs:
            seconds = runs[-1]["seconds"] if seconds is None else seconds
            seed = 100 + 100_000 * len(runs)  # (no run's prompt a cached prefix of another's)
            run = asyncio.run(drive(url, shorts, long_prompt, seconds, seed, spy))
            run["peak_reserved_gib"] = scrape(url, "headspace_gpu_peak_reserved_bytes") / GiB
            run["peak_reserved_gib_at_ready"] = ready_peak_gib
            runs.append(run)
    finally:
        for process in spies:
            process.wait(timeout=SPY_SECONDS + 60)
        server.send_signal(signal.SIGINT)
        server.wait(timeout=120)
    return runs


def record_threads(pid: int, seconds: float, path: Path) -> list[subprocess.Popen]:
    """py-spy sampling the threads of ``pid`` for ``seconds``: every thread, idle ones too (a
    thread waiting shows where), into ``path``; and only the thread holding the GIL into
    ``<path>_gil.json`` (how the threads share it). Speedscope JSON: each thread's samples
    in time order. None started without py-spy on the PATH."""
    binary = shutil.which("py-spy")
    if binary is None:
        print("py-spy is not on the PATH: no profile", file=sys.stderr)
        return []
    spies = []
    for extra, out in (("--idle", path), ("--gil", path.with_name(path.stem + "_gil.json"))):
        command = [binary, "record", "--pid", str(pid), "--duration", str(seconds), "--rate",
                   "200", "--threads", extra, "--nonblocking", "--format", "speedscope",
                   "--output", str(out)]  # fmt: skip
        with open(out.with_suffix(".log"), "w") as said:  # (what py-spy says, beside it)
            spies.append(subprocess.Popen(command, stdout=said, stderr=subprocess.STDOUT))
    return spies


def long_figures(run: dict, prompt_len: int) -> dict:
    long = run["long"]
    if "error" in long or len(long["times"]) < 2:
        return {"error": long.get("error", "no tokens")}
    first, last = long["times"][0], long["times"][-1]
    return {"ttft_s": first - long["sent"], "first_at": first, "last_at": last,
            "decode_ms": 1e3 * (last - first) / (len(long["times"]) - 1),
            "entries": run["entries"], "prompt_tokens": prompt_len}  # fmt: skip


def floor_ms(entries: dict, tokens: int, h2d: float, cpu: float) -> float:
    """The long request's decode floor for its placement: its offloaded entries' K/V (bf16)
    over PCIe, with hybrid heads split between PCIe and the CPU at the measured rates."""
    cfg = LLAMA31_8B
    entry_bytes = 2 * tokens * cfg["head_dim"] * 2
    offloaded = entries.get("streamed", 0) + entries.get("hybrid", 0)
    hybrid = entries.get("hybrid", 0) > 0
    layers = cfg["num_hidden_layers"]
    hw = Hardware(h2d_bytes=h2d, cpu_attention_bytes=cpu)
    return 1e3 * offloaded_seconds(offloaded * entry_bytes, layers, hybrid, None, hw)


def largest_gaps(pairs: list[tuple[float, float]], start: float, count: int = 8) -> list:
    """The ``count`` longest gaps of ``pairs`` as (ms, seconds after ``start`` it ended)."""
    ranked = sorted(pairs, reverse=True)[:count]
    return [(round(1e3 * gap, 1), round(at - start, 2)) for gap, at in ranked]


def scenario(name: str, model_dir: Path, h2d: float, cpu: float, flags: tuple = (),
             profile: Path | None = None) -> dict:  # fmt: skip
    count, short_len, short_new, long_len = SCENARIOS[name]
    shorts = (count, short_len, short_new)
    long_prompt = ids(long_len, 999)
    kv_token = LLAMA31_8B["num_hidden_layers"] * LLAMA31_8B["num_key_value_heads"] * 128 * 2 * 2
    short_kv_gib = count * (short_len + short_new) * kv_token / GiB  # their peak KV
    jobs = [(shorts, long_prompt, 0.0), (shorts, None, None)]
    mixed, alone_short = serve_run(model_dir, BUDGET_GIB, jobs, *flags, profile=profile)
    # (no arena kept for arrivals: the short streams' KV is what the budget leaves out)
    (alone_long,) = serve_run(
        model_dir,
        BUDGET_GIB - short_kv_gib,
        [((0, 0, 0), long_prompt, 0.0)],
        "--resident-reserve",
        "0",
        *flags,
    )
    long, long_alone = long_figures(mixed, long_len), long_figures(alone_long, long_len)
    if "error" in long or "error" in long_alone:
        return {"error": long.get("error") or long_alone.get("error")}
    all_gaps, alone_gaps = gaps(mixed["shorts"]), gaps(alone_short["shorts"])
    prefill = [
        g for g, at in all_gaps if long["first_at"] - long["ttft_s"] < at <= long["first_at"]
    ]
    decode = [g for g, at in all_gaps if long["first_at"] < at <= long["last_at"]]
    sent = long["first_at"] - long["ttft_s"]
    in_prefill = [(g, at) for g, at in all_gaps if sent < at <= long["first_at"]]
    in_decode = [(g, at) for g, at in all_gaps if long["first_at"] < at <= long["last_at"]]
    p50, p99 = percentiles([g for g, _ in all_gaps])
    alone50, alone99 = percentiles([g for g, _ in alone_gaps])
    failed = sum("error" in r for r in mixed["shorts"] + alone_short["shorts"])
    return {
        "short_tpot_p50_ms": 1e3 * p50, "short_tpot_p99_ms": 1e3 * p99,
        "short_tpot_p50_ms_alone": 1e3 * alone50, "short_tpot_p99_ms_alone": 1e3 * alone99,
        "short_tpot_p99_ms_during_long_prefill": 1e3 * percentiles(prefill)[1],
        "short_tpot_p99_ms_during_long_decode": 1e3 * percentiles(decode)[1],
        "short_tokens_during_long_prefill": len(prefill),
        "short_tokens_during_long_decode": len(decode),
        # (ms, seconds after the long prompt was sent)
        "short_largest_gaps_during_long_prefill": largest_gaps(in_prefill, sent),
        "short_largest_gaps_during_long_decode": largest_gaps(in_decode, sent),
        "long_ttft_s": long["ttft_s"], "long_ttft_s_alone": long_alone["ttft_s"],
        "long_decode_ms": long["decode_ms"], "long_decode_ms_alone": long_alone["decode_ms"],
        "long_decode_floor_ms": floor_ms(long["entries"], long_len, h2d, cpu),
        "long_placement": long["entries"], "long_placement_alone": long_alone["entries"],
        "peak_reserved_gib": max(mixed["peak_reserved_gib"], alone_short["peak_reserved_gib"]),
        "peak_reserved_gib_at_ready": mixed["peak_reserved_gib_at_ready"],
        "budget_gib": BUDGET_GIB, "alone_budget_gib": BUDGET_GIB - short_kv_gib,
        "num_failed": failed + ("error" in mixed["long"]),
        "timeline": mixed["timeline"],  # the lanes' series each second while the long one ran
        "short_ttft_s_p50": percentiles([r["times"][0] - r["sent"] for r in mixed["shorts"]
                                         if r["times"]])[0],  # fmt: skip
        "workload": {"short_streams": count, "short_prompt": short_len, "short_new": short_new,
                     "long_prompt": long_len, "long_new": LONG_NEW,
                     "long_after_s": LONG_AFTER_S},
    }  # fmt: skip


def targets(row: dict) -> dict:
    """Each target of the scenario: (measured ratio, bound, met)."""
    checks = {
        "short p50 vs alone": (row["short_tpot_p50_ms"] / row["short_tpot_p50_ms_alone"], 1.2),
        "short p99 in decode vs alone": (row["short_tpot_p99_ms_during_long_decode"]
                                         / row["short_tpot_p99_ms_alone"], 2.0),
        "short p99 in prefill vs alone": (row["short_tpot_p99_ms_during_long_prefill"]
                                          / row["short_tpot_p99_ms_alone"], 3.0),
        "long ttft vs alone": (row["long_ttft_s"] / row["long_ttft_s_alone"], 1.2),
        "long decode vs alone": (row["long_decode_ms"] / row["long_decode_ms_alone"], 1.2),
        "long decode vs floor": (row["long_decode_ms"] / row["long_decode_floor_ms"], 1.3),
        "peak vs budget": (row["peak_reserved_gib"] / row["budget_gib"], 1.02),
    }  # fmt: skip
    return {
        name: (None, bound, False) if math.isnan(value) else (value, bound, value <= bound)
        for name, (value, bound) in checks.items()
    }  # (NaN: no token in that window)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default="a,b,c", help="which of a, b, c")
    parser.add_argument("--tag", default="", help="added to the file name")
    parser.add_argument("--serve-flags", default="", help="more flags for every server, "
                        "e.g. '--prefill-sm-share 1'")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="py-spy the mixed server's "
                        f"threads for {SPY_SECONDS} s from the long request's arrival "
                        "(speedscope files beside the result)")  # fmt: skip
    args = parser.parse_args()
    env = environment()
    from cpu_attention import kernel_gb_s

    h2d = pinned_h2d_bandwidth()
    cpu = kernel_gb_s(128 * K, 4, max(1, (os.cpu_count() or 2) - 1)) * 1e9  # as the engine runs it
    result = {"env": env, "config": LLAMA31_8B, "gpu_memory": f"{BUDGET_GIB}GiB",
              "host_memory": HOST, "h2d_bytes_per_s": h2d, "cpu_attention_bytes_per_s": cpu,
              "serve_flags": args.serve_flags, "scenarios": {}}  # fmt: skip
    tag = f"_{args.tag}" if args.tag else ""
    name_of_file = f"mixed{tag}_llama3-8b_{gpu_tag(env)}_{env['date']}.json"
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        model_dir = Path(tmp) / "llama3-8b-random"
        save_checkpoint(model_dir)
        for name in args.scenarios.split(","):
            spied = Path(os.environ.get("OUT", ".")) / f"mixed{tag}_threads_{name}.json"
            row = scenario(name, model_dir, h2d, cpu, tuple(args.serve_flags.split()),
                           spied if args.profile else None)  # fmt: skip
            if "error" not in row:
                row["targets"] = targets(row)
                row = {k: None if isinstance(v, float) and math.isnan(v) else v
                       for k, v in row.items()}  # (JSON has no NaN)  # fmt: skip
            result["scenarios"][name] = row
            for key in KEYS:  # the keys at the top: {scenario: value}
                result[key] = {n: r.get(key) for n, r in result["scenarios"].items()}
            path = write_result(name_of_file, result)  # (after each scenario)
            print(name, row, flush=True)
    print(f"\nwrote {path}")
    _print(result)


def _print(result: dict) -> None:
    print(f"\n{'scenario':<9}{'target':<32}{'measured':>10}{'bound':>8}  met")
    for name, row in result["scenarios"].items():
        if "error" in row:
            print(f"{name:<9}error: {row['error']}")
            continue
        for target, (value, bound, met) in row["targets"].items():
            shown = "-" if value is None else f"{value:.3f}"
            print(f"{name:<9}{target:<32}{shown:>10}{bound:>8.2f}  {'yes' if met else 'NO'}")


if __name__ == "__main__":
    main()

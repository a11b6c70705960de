"""Serving over HTTP: a load generator against ``headspace serve`` (as ``vllm bench serve``).

    PYTHONPATH=src python bench/serve.py        # on a GPU machine, about eight minutes

Llama-3.1-8B's architecture with random bf16 weights saved as a checkpoint (a word-level
tokenizer over its 128,256 ids: prompts are token ids, text is ``t<id>`` words), served as
a user serves it: ``headspace serve --model DIR --device cuda --gpu-memory 24GiB``. The
requests (fixed seed): prompts of 1K-16K tokens, a few of 32K-128K, some sharing a 32K
prefix; 64-256 new tokens each, arriving as a Poisson process whose span is ``LOAD`` x the
offline run's time. Each is streamed (time to first token, time per output token from the
chunks' arrival). First the same requests go through ``LLM.generate`` at once in this
process (the offline figure, and the arrival rate), then the server runs in a process of its
own. Writes ``serve_llama3-8b_<gpu>_<date>.json`` (to $OUT when set).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import LLAMA31_8B, environment, gpu_tag, ran_view, random_hf_llama, write_result  # noqa: E402

K = 1024
BUDGET = "24GiB"
LOAD = 0.8  # the arrivals' span over the offline run's time
NAME = "llama3-8b-random"


def save_checkpoint(path: Path) -> None:
    """Random Llama-3.1-8B weights (bf16) and a word-level tokenizer over its ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = random_hf_llama(LLAMA31_8B)
    model.save_pretrained(path, max_shard_size="5GB")
    del model
    torch.cuda.empty_cache()
    vocab = {f"t{i}": i for i in range(LLAMA31_8B["vocab_size"])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, bos_token="t128000",
                                        eos_token="t128001")  # fmt: skip
    tokenizer.save_pretrained(path)


def workload(seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens) in arrival order: 20 of 1K-16K (log-uniform), two of 32K,
    one of 64K and one of 128K, and four sharing one 32K prefix with their own 1K tails."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 128000, (n,), generator=generator).tolist()

    prefix = ids(32 * K)
    prompts = [ids(int(2 ** rng.uniform(10, 14))) for _ in range(20)]
    for at, length in ((4, 32 * K), (9, 64 * K), (14, 126 * K), (18, 32 * K)):
        prompts.insert(at, ids(length))
    for at in (6, 11, 16, 21):
        prompts.insert(at, prefix + ids(K))
    return [(p, rng.randint(64, 256)) for p in prompts]


def offline(model_dir: Path, requests, **options) -> dict:
    """The same requests given to ``LLM.generate`` at once (after a warm-up batch), the
    engine given ``options`` beside the budget."""
    from headspace import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cuda", gpu_memory=BUDGET, **options)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n in requests]
    llm.generate([p[:2048] for p, _ in requests[:6]],
                 [SamplingParams(max_new_tokens=8, ignore_eos=True)] * 6)  # fmt: skip
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    head_map = ran_view(llm.engine).layout
    del llm
    torch.cuda.empty_cache()
    return {"seconds": seconds, "output_tokens": tokens, "head_map": head_map}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, *flags: str,
                 budget: str = BUDGET) -> tuple[subprocess.Popen, str]:  # fmt: skip
    """``headspace serve`` of ``model_dir`` under the GPU ``budget`` (and ``flags``), once
    its /health says ready; (process, base URL)."""
    server, url, _ = start_server_timed(model_dir, *flags, budget=budget)
    return server, url


def start_server_timed(model_dir: Path, *flags: str, budget: str = BUDGET,
                       env: dict | None = None) -> tuple[subprocess.Popen, str, float]:  # fmt: skip
    """As :func:`start_server`, in ``env`` (default: this one's); also its seconds from
    start to ready."""
    port = free_port()
    command = [sys.executable, "-m", "headspace.cli", "serve", "--model", str(model_dir),
               "--device", "cuda", "--gpu-memory", budget, "--port", str(port),
               "--served-model-name", NAME, *flags]  # fmt: skip
    return wait_ready(command, f"http://127.0.0.1:{port}", env)


def wait_ready(command: list[str], url: str,
               env: dict | None = None) -> tuple[subprocess.Popen, str, float]:  # fmt: skip
    """Start ``command`` (a server) and wait until ``url``/health answers 200: (process,
    ``url``, seconds from start to ready)."""
    server = subprocess.Popen(command, env=dict(env or os.environ, PYTHONUNBUFFERED="1"))
    started = time.perf_counter()
    while time.perf_counter() - started < 600:
        if server.poll() is not None:
            raise SystemExit("the server exited")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                ready = time.perf_counter() - started
                print(f"server ready in {ready:.1f} s", flush=True)
                return server, url, ready
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server was not ready in 600 s")


async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed completion: send time, each text chunk's arrival, usage; or its error."""
    sent, times, usage = time.perf_counter(), [], None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                return {"error": f"{reply.status_code} {(await reply.aread())[:300]!r}"}
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return {"error": str(event["error"])[:300]}
                if event.get("usage"):
                    usage = event["usage"]
                if event.get("choices") and event["choices"][0].get("text"):
                    times.append(time.perf_counter())
    except httpx.HTTPError as error:
        return {"error": repr(error)}
    return {"sent": sent, "times": times, "usage": usage}


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], new: int,
              delay: float) -> dict:  # fmt: skip
    """Stream one completion after ``delay`` s: its chunk times and usage, or its error."""
    await asyncio.sleep(delay)
    body = {"model": NAME, "prompt": prompt, "max_tokens": new, "ignore_eos": True,
            "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    return await stream_one(client, url, body)


def percentiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    if not ordered:
        return float("nan"), float("nan")
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


async def online(url: str, requests, rate: float) -> dict:
    rng, delays, clock = random.Random(1), [], 0.0
    for _ in requests:
        delays.append(clock)
        clock += rng.expovariate(rate)
    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800), limits=limits) as client:
        start = time.perf_counter()
        sends = [one(client, url, p, n, d) for (p, n), d in zip(requests, delays, strict=True)]
        results = await asyncio.gather(*sends)
    return {"results": results, "start": start, "arrivals_s": delays}


def summarise(run: dict) -> dict:
    done = [r for r in run["results"] if "error" not in r and r["usage"] and r["times"]]
    end = max(r["times"][-1] for r in done)
    seconds = end - run["start"]
    tokens = sum(r["usage"]["completion_tokens"] for r in done)
    ttft = [r["times"][0] - r["sent"] for r in done]
    tpot = [(r["times"][-1] - r["times"][0]) / (r["usage"]["completion_tokens"] - 1)
            for r in done if r["usage"]["completion_tokens"] > 1]  # fmt: skip
    ttft50, ttft99 = percentiles(ttft)
    tpot50, tpot99 = percentiles(tpot)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in done)
    return {"request_throughput": len(done) / seconds, "output_tok_s": tokens / seconds,
            "ttft_p50_s": ttft50, "ttft_p99_s": ttft99, "tpot_p50_ms": 1e3 * tpot50,
            "tpot_p99_ms": 1e3 * tpot99, "num_failed": len(run["results"]) - len(done),
            "cached_prompt_tokens": cached, "online_seconds": seconds,
            "errors": [r["error"] for r in run["results"] if "error" in r][:5]}  # fmt: skip


def scrape(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    options, flags = {}, []
    env = environment()
    requests = workload()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        model_dir = Path(tmp) / "llama3-8b-random"
        save_checkpoint(model_dir)
        base = offline(model_dir, requests, **options)
        rate = len(requests) / (LOAD * base["seconds"])
        print(f"offline {base['output_tokens'] / base['seconds']:.1f} tok/s "
              f"in {base['seconds']:.1f} s", flush=True)  # fmt: skip
        server, url = start_server(model_dir, *flags)
        try:
            run = asyncio.run(online(url, requests, rate))
            reserved = scrape(url, "headspace_gpu_peak_reserved_bytes") / 2**30
            pages = scrape(url, f'headspace_kv_pages_in_use{{model_name="{NAME}",tier="gpu"}}')
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(timeout=60)
    stats = summarise(run)
    offline_tok_s = base["output_tokens"] / base["seconds"]
    result = {
        "env": env, "config": LLAMA31_8B, "gpu_memory": BUDGET, "head_map": base["head_map"],
        "workload": {"prompt_lengths": [len(p) for p, _ in requests],
                     "new_tokens": [n for _, n in requests], "load": LOAD,
                     "arrival_rate_per_s": rate, "arrivals_s": run["arrivals_s"]},
        **{k: v for k, v in stats.items()},
        "offline_output_tok_s": offline_tok_s,
        "serving_overhead": 1 - stats["output_tok_s"] / offline_tok_s,
        "peak_reserved_gib": reserved, "budget_gib": 24, "gpu_pages_in_use_after": pages,
        "offline_seconds": base["seconds"],
    }  # fmt: skip
    path = write_result(f"serve_llama3-8b_{gpu_tag(env)}_{env['date']}.json", result)
    print(f"\nwrote {path}")
    for key in ("request_throughput", "output_tok_s", "offline_output_tok_s", "serving_overhead",
                "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms", "num_failed",
                "cached_prompt_tokens", "peak_reserved_gib"):  # fmt: skip
        print(f"{key:<24}{result[key]:>12.3f}")


if __name__ == "__main__":
    main()

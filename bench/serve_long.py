"""One request of 512K tokens through ``headspace serve`` under a 24 GiB GPU budget while
short requests keep arriving.

    PYTHONPATH=src python bench/serve_long.py     # a GPU machine with 128 GiB of host memory

Llama-3.1-8B's architecture with random bf16 weights saved as a checkpoint (as
``bench/serve.py``), served with ``--gpu-memory 24GiB --max-context 524288``: its KV (64 GiB)
lives mostly in host pages. Eight short requests (2K tokens, 256 new) start first; the long
one (``--tokens``, 64 new) follows; a short one arrives every ``--every`` seconds while it
runs. Reported: the long request's time to first token and decode ms/token, the short ones'
time per output token (p50, and p99 during the long prefill), the head map's entries by
tier while it decodes, peak reserved GPU memory, and the server's peak resident host
memory. Writes ``serve_long_llama3-8b_<gpu>_<date>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import LLAMA31_8B, environment, gpu_tag, write_result  # noqa: E402
from serve import BUDGET, NAME, one, percentiles, save_checkpoint, scrape, start_server  # noqa: E402

K = 1024


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 128000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def run(url: str, tokens: int, every: float, window_s: float) -> dict:
    """The short requests and the long one; each one's chunk times."""
    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600), limits=limits) as client:
        shorts = [asyncio.ensure_future(one(client, url, ids(2 * K, i), 256, 0.0))
                  for i in range(8)]  # fmt: skip
        long = asyncio.ensure_future(one(client, url, ids(tokens, 999), 64, 2.0))
        start, seed, entries = time.perf_counter(), 100, {}
        while not long.done() and time.perf_counter() - start < window_s:
            await asyncio.sleep(every)
            shorts.append(asyncio.ensure_future(one(client, url, ids(2 * K, seed), 64, 0.0)))
            seed += 1
            entries = await asyncio.to_thread(_entries, url)  # the map in force now
        return {"long": await long, "shorts": await asyncio.gather(*shorts), "entries": entries}


def _entries(url: str) -> dict[str, float]:
    """The head map's (layer, kv head) entries by tier, from the server's metrics."""
    return {tier: scrape(url, f'headspace_head_entries{{model_name="{NAME}",tier="{tier}"}}')
            for tier in ("resident", "streamed", "hybrid")}  # fmt: skip


def peak_rss(pid: int) -> int:
    """The process's peak resident bytes (Linux's VmHWM)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def summarise(result: dict, tokens: int) -> dict:
    long = result["long"]
    if "error" in long or not long["times"]:
        raise SystemExit(f"the long request failed: {long.get('error')}")
    first, last = long["times"][0], long["times"][-1]
    generated = long["usage"]["completion_tokens"]
    shorts = [r for r in result["shorts"] if "error" not in r and len(r["times"]) > 1]
    gaps = [(b - a, b) for r in shorts for a, b in zip(r["times"], r["times"][1:], strict=False)]
    during = [g for g, at in gaps if long["sent"] < at <= first]
    tpot50, _ = percentiles([g for g, _ in gaps])
    _, during99 = percentiles(during)
    return {"long_prompt_tokens": tokens, "long_ttft_s": first - long["sent"],
            "long_decode_ms_per_token": 1e3 * (last - first) / max(generated - 1, 1),
            "short_tpot_p50_ms": 1e3 * tpot50,
            "short_tpot_p99_ms_during_long_prefill": 1e3 * during99,
            "short_tokens_during_long_prefill": len(during),
            "short_requests": len(result["shorts"]),
            "short_failed": len(result["shorts"]) - len(shorts),
            "head_entries_while_long_runs": result["entries"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512 * K - 2 * K, help="long prompt")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between shorts")
    parser.add_argument("--window", type=float, default=400.0, help="most seconds of shorts")
    parser.add_argument("--tag", default="", help="added to the file name (serve_long_<tag>_...)")
    args = parser.parse_args()
    env = environment()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        model_dir = Path(tmp) / "llama3-8b-random"
        save_checkpoint(model_dir)
        server, url = start_server(model_dir, "--max-context", str(512 * K))
        try:
            result = asyncio.run(run(url, args.tokens, args.every, args.window))
            reserved = scrape(url, "headspace_gpu_peak_reserved_bytes") / 2**30
            host_peak = peak_rss(server.pid) / 2**30
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(timeout=120)
    summary = summarise(result, args.tokens)
    out = {"env": env, "config": LLAMA31_8B, "gpu_memory": BUDGET, **summary,
           "peak_reserved_gib": reserved, "budget_gib": 24,
           "server_peak_host_gib": host_peak}  # fmt: skip
    tag = f"{args.tag}_" if args.tag else ""
    path = write_result(f"serve_long_{tag}llama3-8b_{gpu_tag(env)}_{env['date']}.json", out)
    print(f"\nwrote {path}")
    for key, value in summary.items():
        print(f"{key:<40}{value}")
    print(f"{'peak_reserved_gib':<40}{reserved:.2f}")
    print(f"{'server_peak_host_gib':<40}{host_peak:.2f}")


if __name__ == "__main__":
    main()

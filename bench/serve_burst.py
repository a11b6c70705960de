"""A burst of 16 requests at once: a fresh server, a warm one, and `transformers serve`.

    PYTHONPATH=src python bench/serve_burst.py     # on a GPU machine, about eight minutes

Llama-3.1-8B's architecture with random bf16 weights saved as a checkpoint (a word-level
tokenizer over its ids, text ``t<id>`` words), served as a user serves it: ``headspace
serve --model DIR --device cuda --gpu-memory 24GiB``, default options. Sixteen prompts of
1K-8K tokens (log-uniform, fixed seed), 64 new tokens each, sent together as text and
streamed (time to first token, time per output token from the chunks' arrival):
- fresh: the server started over empty caches (headspace's, Inductor's and Triton's in new
  directories, as on a fresh machine): its seconds to ready, then its first burst;
- warm: a second burst of other prompts of the same lengths to the same server (no prefix
  in common with the first);
- peer: ``transformers serve --continuous-batching`` on the same checkpoint, one burst
  after a small one that starts its batching thread.
The bounds, measured in the same run: the prefill rate (one 8K prompt alone on the warm
server) gives ``prefill_bound_s`` (the burst's prompt tokens at that rate); the HBM rate
gives ``tpot_roofline_ms`` (one decode step of all 16 requests: the weights and their K/V,
each read once). Writes ``serve_burst16_llama3-8b_<gpu>_<date>.json`` (to $OUT when set).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import LLAMA31_8B, environment, gpu_tag, measure_hbm_bandwidth, write_result  # noqa: E402
from mixed import lane_sample  # noqa: E402
from serve import (  # noqa: E402
    BUDGET,
    NAME,
    free_port,
    percentiles,
    save_checkpoint,
    start_server_timed,
    stream_one,
    wait_ready,
)

K = 1024
REQUESTS, NEW_TOKENS = 16, 64
PREFILL_PROBE = 8 * K  # the prompt that measures the prefill rate
SAMPLE_S = 0.25  # how often the lanes' series are read during a burst


def prompts(seed: int, lengths: list[int] | None = None) -> list[str]:
    """``REQUESTS`` text prompts of 1K-8K words (or of ``lengths``), ids from ``seed``."""
    if lengths is None:
        draw = random.Random(0)
        lengths = [int(2 ** draw.uniform(10, 13)) for _ in range(REQUESTS)]
    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(128000)}" for _ in range(n)) for n in lengths]


def burst(url: str, texts: list[str], model: str, new_tokens: int = NEW_TOKENS,
          headspace: bool = True) -> dict:  # fmt: skip
    """``texts`` sent at once; each body as the server takes it (``ignore_eos`` is
    headspace's, which ``transformers serve`` refuses)."""

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=len(texts))
        async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as client:
            bodies = [{"model": model, "prompt": text, "max_tokens": new_tokens,
                       "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}} for text in texts]  # fmt: skip
            if not headspace:
                return await asyncio.gather(*(stream_one(client, url, b) for b in bodies))
            for body in bodies:
                body["ignore_eos"] = True
            sends = asyncio.gather(*(stream_one(client, url, b) for b in bodies))
            while not sends.done():  # the lanes' steps and prefilled tokens, as they go
                sample = await asyncio.to_thread(lane_sample, url)
                timeline.append({"t": round(time.perf_counter() - start, 2), **sample})
                await asyncio.wait([sends], timeout=SAMPLE_S)
            return sends.result()

    start, timeline = time.perf_counter(), []
    return {"start": start, "results": asyncio.run(run()), "timeline": timeline}


def figures(run: dict) -> dict:
    """Time to first token, time per output token (p50, p99), output tokens/s, failures."""
    done = [r for r in run["results"] if "error" not in r and r["times"] and r["usage"]]
    ttft = [r["times"][0] - r["sent"] for r in done]
    tpot = [(r["times"][-1] - r["times"][0]) / (r["usage"]["completion_tokens"] - 1)
            for r in done if r["usage"]["completion_tokens"] > 1]  # fmt: skip
    tokens = sum(r["usage"]["completion_tokens"] for r in done)
    end = max((r["times"][-1] for r in done), default=run["start"])
    (ttft50, ttft99), (tpot50, tpot99) = percentiles(ttft), percentiles(tpot)
    return {"ttft_p50_s": ttft50, "ttft_p99_s": ttft99, "tpot_p50_ms": 1e3 * tpot50,
            "tpot_p99_ms": 1e3 * tpot99, "output_tok_s": tokens / max(end - run["start"], 1e-9),
            "output_tokens": tokens, "num_failed": len(run["results"]) - len(done),
            "errors": [r["error"] for r in run["results"] if "error" in r][:3],
            "timeline": run.get("timeline", [])}  # fmt: skip


def _short(run: dict) -> dict:
    return {k: v for k, v in run.items() if k != "timeline"}


def roofline_ms(lengths: list[int], hbm: float) -> float:
    """One decode step of all the requests at ``hbm`` bytes/s: the decoder layers' and the
    LM head's bf16 weights, and each request's K/V (its prompt and half its new tokens)."""
    c = LLAMA31_8B
    hidden, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    head_dim = hidden // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    layer = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * inter
    weight_bytes = 2 * (layers * layer + c["vocab_size"] * hidden)
    kv_bytes = sum(n + NEW_TOKENS // 2 for n in lengths) * layers * 2 * kv * 2
    return 1e3 * (weight_bytes + kv_bytes) / hbm


def stop(server) -> None:
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=60)
    except Exception:  # noqa: BLE001 (a peer slow to stop)
        server.kill()


def headspace_runs(model_dir: Path, lengths: list[int], caches: Path) -> dict:
    """The fresh server's readiness and first burst, then its warm burst and the prefill
    probe."""
    env = dict(os.environ, HEADSPACE_CACHE=str(caches / "headspace"),
               TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
               TRITON_CACHE_DIR=str(caches / "triton"))  # fmt: skip
    server, url, ready_s = start_server_timed(model_dir, budget=BUDGET, env=env)
    try:
        fresh = figures(burst(url, prompts(1, lengths), NAME))
        print(f"fresh burst: {_short(fresh)}", flush=True)
        warm = figures(burst(url, prompts(2, lengths), NAME))
        print(f"warm burst: {_short(warm)}", flush=True)
        probe = burst(url, prompts(3, [PREFILL_PROBE]), NAME, new_tokens=1)["results"][0]
        probe_s = probe["times"][0] - probe["sent"]
    finally:
        stop(server)
    return {"ready_s": ready_s, "fresh": fresh, "warm": warm,
            "prefill_tok_s": PREFILL_PROBE / probe_s}  # fmt: skip


def variant_runs(model_dir: Path, lengths: list[int], caches: Path,
                 variants: list[str]) -> dict:  # fmt: skip
    """Each of ``variants`` (server flags) on a server over the fresh run's caches: a first
    burst (``first``: what a new process pays for beyond the disk caches, as cuDNN's plans
    and the decode graphs' captures, which live in the process), then the measured one
    (the warm run's prompts)."""
    env = dict(os.environ, HEADSPACE_CACHE=str(caches / "headspace"),
               TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
               TRITON_CACHE_DIR=str(caches / "triton"))  # fmt: skip
    runs = {}
    for flags in variants:
        server, url, _ = start_server_timed(model_dir, *flags.split(), budget=BUDGET, env=env)
        try:
            first = _short(figures(burst(url, prompts(1, lengths), NAME)))
            runs[flags] = _short(figures(burst(url, prompts(2, lengths), NAME)))
            runs[flags]["first"] = first
            print(f"variant {flags!r}: {runs[flags]}", flush=True)
        finally:
            stop(server)
    return runs


def peer_run(model_dir: Path, lengths: list[int]) -> dict:
    """``transformers serve --continuous-batching`` of the same checkpoint: one burst after
    a small one."""
    port = free_port()
    command = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir),
               "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
               "--device", "cuda"]  # fmt: skip
    server, url, ready_s = wait_ready(command, f"http://127.0.0.1:{port}")
    try:
        burst(url, prompts(4, [256] * 4), str(model_dir), new_tokens=8, headspace=False)
        run = figures(burst(url, prompts(2, lengths), str(model_dir), headspace=False))
        print(f"peer burst: {_short(run)}", flush=True)
    finally:
        stop(server)
    return {"ready_s": ready_s, **run}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-peer", action="store_true", help="leave transformers serve out")
    parser.add_argument("--variant", action="append", default=[],
                        help="server flags of another warm burst (repeatable): e.g. "
                        "'--no-mixed-steps' or '--prefill-slowdown 2'")  # fmt: skip
    args = parser.parse_args()
    env = environment()
    hbm = measure_hbm_bandwidth()
    torch.cuda.empty_cache()
    lengths = [len(p.split()) for p in prompts(0)]
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        model_dir = Path(tmp) / "llama3-8b-random"
        started = time.perf_counter()
        save_checkpoint(model_dir)
        print(f"checkpoint saved in {time.perf_counter() - started:.0f} s", flush=True)
        ours = headspace_runs(model_dir, lengths, Path(tmp) / "caches")
        variants = variant_runs(model_dir, lengths, Path(tmp) / "caches", args.variant)
        peer = None
        if not args.no_peer:  # (a peer that fails to start or serve leaves ours recorded)
            try:
                peer = peer_run(model_dir, lengths)
            except (Exception, SystemExit) as error:  # noqa: BLE001
                print(f"peer failed: {error!r}", flush=True)
                peer = {"error": repr(error)[:500], "ttft_p50_s": None, "tpot_p50_ms": None,
                        "output_tok_s": None}  # fmt: skip
    warm = ours["warm"]
    result = {
        "env": env, "config": LLAMA31_8B, "gpu_memory": BUDGET, "hbm_bytes_per_s": hbm,
        "workload": {"prompt_lengths": lengths, "new_tokens": NEW_TOKENS,
                     "prompt_tokens": sum(lengths)},
        **{k: warm[k] for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms",
                                "output_tok_s")},
        "tpot_roofline_ms": roofline_ms(lengths, hbm),
        "prefill_bound_s": sum(lengths) / ours["prefill_tok_s"],
        "prefill_tok_s": ours["prefill_tok_s"],
        "fresh_ttft_p50_s": ours["fresh"]["ttft_p50_s"], "ready_s": ours["ready_s"],
        "peer_ttft_p50_s": peer and peer["ttft_p50_s"],
        "peer_tpot_p50_ms": peer and peer["tpot_p50_ms"],
        "peer_output_tok_s": peer and peer["output_tok_s"],
        "num_failed": warm["num_failed"] + ours["fresh"]["num_failed"],
        "runs": {"fresh": ours["fresh"], "warm": warm, "peer": peer},
        "variants": variants,  # server flags -> their warm burst (default flags above)
    }  # fmt: skip
    path = write_result(f"serve_burst16_llama3-8b_{gpu_tag(env)}_{env['date']}.json", result)
    print(f"\nwrote {path}")
    for key in ("ready_s", "fresh_ttft_p50_s", "ttft_p50_s", "ttft_p99_s", "prefill_bound_s",
                "peer_ttft_p50_s", "tpot_p50_ms", "tpot_p99_ms", "tpot_roofline_ms",
                "peer_tpot_p50_ms", "output_tok_s", "peer_output_tok_s", "num_failed"):  # fmt: skip
        value = result[key]
        print(f"{key:<20}{value:>12.3f}" if value is not None else f"{key:<20}{'-':>12}")


if __name__ == "__main__":
    main()

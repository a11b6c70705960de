"""Offload that batches: 8 concurrent requests of 32K-64K tokens (more KV than the GPU holds)
on Llama-3.1-8B with random bf16 weights, the GPU capped at 24 GiB.

    PYTHONPATH=src python bench/batch_offload.py      # on a GPU machine, about six minutes

The engine is built as a user builds it (the model's 128K context, a 23 GiB budget under
the 24 GiB cap, default options) and given all eight requests at once; it decides what runs
together and which heads stream. Measured in the same run: each request alone (greedy
outputs must be equal), the pinned host-to-device bandwidth (the PCIe floor of what
streams), and transformers' batched decode over ``DynamicCache(offloading=True)`` for the
same lengths. Writes ``batch_offload_llama3-8b_<gpu>_<date>.json`` (to $OUT when set).
"""

from __future__ import annotations

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
    measure_hbm_bandwidth,
    pinned_h2d_bandwidth,
    random_hf_llama,
    random_model,
    write_result,
)
from headspace.engine.sampling import SamplingParams  # noqa: E402
from offload_runs import gpu_cap  # noqa: E402

K, GiB = 1024, 2**30
LENGTHS = [32 * K, 36 * K, 40 * K, 44 * K, 48 * K, 52 * K, 56 * K, 64 * K]
NEW_TOKENS = 64
CAP_GIB, BUDGET = 24, "23GiB"


def _prompts(seed: int) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    return [torch.randint(0, LLAMA31_8B["vocab_size"], (n,), generator=rng).tolist()
            for n in LENGTHS]  # fmt: skip


def _decode_window(outputs) -> float:
    """Seconds during which some request was decoding (requests were submitted together)."""
    spans = sorted((o.stats.prefill_seconds, o.stats.prefill_seconds + o.stats.decode_seconds)
                   for o in outputs)  # fmt: skip
    total, end = 0.0, 0.0
    for start, stop in spans:
        total += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total


def headspace_batch(model, h2d: float, check_single: bool = True) -> dict:
    """The eight requests at once (after a warm-up batch); ``check_single``: each again
    alone, their tokens compared (``outputs_equal_single``; None when not checked)."""
    engine = make_engine(model, gpu_memory=BUDGET)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    warm = SamplingParams(max_new_tokens=4, ignore_eos=True)  # compiles every layout's shapes
    engine.generate_batch(_prompts(1), [warm] * len(LENGTHS))
    torch.cuda.reset_peak_memory_stats()
    prompts = _prompts(2)
    start = time.perf_counter()
    outputs = engine.generate_batch(prompts, [params] * len(prompts))
    wall = time.perf_counter() - start
    peak_reserved = torch.cuda.max_memory_reserved() / GiB
    singles = [engine.generate_batch([p], [params])[0].token_ids
               for p in prompts] if check_single else None  # fmt: skip
    cfg, rows, floor_s, streamed_decode_s = model.config, [], 0.0, 0.0
    for prompt, out in zip(prompts, outputs, strict=True):
        steps = len(out.token_ids) - 1
        context = len(prompt) + NEW_TOKENS // 2  # the mean length while decoding
        streamed = out.stats.num_streamed_heads * 2 * context * cfg.head_dim * 2
        row_floor = steps * streamed / h2d
        rows.append({"prompt_tokens": len(prompt), "decode_ms": 1000 * out.stats.decode_seconds
                     / steps, "pcie_floor_ms": 1000 * row_floor / steps,
                     "summary": out.stats.summary()})  # fmt: skip
        if streamed:
            floor_s += row_floor
            streamed_decode_s += out.stats.decode_seconds
    decode_tokens = sum(len(o.token_ids) - 1 for o in outputs)
    return {
        "num_requests": len(prompts), "wall_seconds": wall,
        "aggregate_decode_tok_s": decode_tokens / _decode_window(outputs),
        "ratio_vs_batch_pcie_floor": streamed_decode_s / floor_s if floor_s else None,
        "peak_reserved_gib": peak_reserved, "budget_gib": 23.0, "gpu_cap_gib": CAP_GIB,
        "outputs_equal_single": None if singles is None else
        [o.token_ids for o in outputs] == singles,
        "requests": rows, "kv_gib": sum(LENGTHS) * cfg.kv_bytes_per_token / GiB,
        "head_maps": sorted({o.stats.summary().split(" | ")[3] for o in outputs}),
    }  # fmt: skip


@torch.inference_mode()
def transformers_offload(lengths: list[int], steps: int = 1) -> dict:
    """Batched decode over DynamicCache(offloading=True): every layer's K/V of the sequences
    (left-padded to the longest) crosses PCIe each step."""
    from transformers import DynamicCache

    start = time.perf_counter()
    hf = random_hf_llama(LLAMA31_8B)
    cfg = hf.config
    batch, longest = len(lengths), max(lengths)
    cache = DynamicCache(config=cfg, offloading=True)
    shape = (batch, cfg.num_key_value_heads, longest, cfg.head_dim)
    for layer in range(cfg.num_hidden_layers):  # the prompts' K/V (values do not matter)
        k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        cache.update(k, torch.randn_like(k), layer)
        del k
    print(f"transformers: model and offloaded cache in {time.perf_counter() - start:.0f} s",
          flush=True)  # fmt: skip
    mask = torch.zeros(batch, longest + steps + 2, dtype=torch.long, device="cuda")
    for row, n in enumerate(lengths):
        mask[row, longest - n :] = 1
    tokens = torch.zeros(batch, 1, dtype=torch.long, device="cuda")

    def step(i: int):
        position = torch.tensor([longest + i], device="cuda")
        out = hf(tokens, past_key_values=cache, attention_mask=mask[:, : longest + i + 1],
                 cache_position=position, use_cache=True)  # fmt: skip
        return out.logits[:, -1].argmax(-1, keepdim=True)

    tokens = step(0)  # warm-up
    torch.cuda.synchronize()
    print(f"transformers: warm-up step done at {time.perf_counter() - start:.0f} s", flush=True)
    start = time.perf_counter()
    for i in range(1, steps + 1):
        tokens = step(i)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    return {"transformers_offload_tok_s": batch / seconds, "transformers_step_s": seconds,
            "transformers_lengths": lengths}  # fmt: skip


def main() -> None:
    env = environment()
    h2d = pinned_h2d_bandwidth()
    result = {"env": env, "config": LLAMA31_8B, "lengths": LENGTHS, "new_tokens": NEW_TOKENS,
              "h2d_bytes_per_s": h2d, "hbm_bytes_per_s": measure_hbm_bandwidth()}  # fmt: skip
    gpu = gpu_tag(env)
    name = f"batch_offload_llama3-8b_{gpu}_{env['date']}.json"
    # transformers first, while this process holds no model and no page-locked host arena:
    # its offloaded cache of the eight sequences, padded to the longest, takes 64 GiB of host
    # memory
    result.update(_transformers_in_subprocess())
    print({k: v for k, v in result.items() if k.startswith("transformers")}, flush=True)
    model = random_model(LLAMA31_8B)
    with gpu_cap(CAP_GIB):
        result.update(headspace_batch(model, h2d))
    if result.get("transformers_offload_tok_s"):  # aggregate tok/s of each batch
        result["speedup_vs_transformers_offload"] = (
            result["aggregate_decode_tok_s"] / result["transformers_offload_tok_s"]
        )
    path = write_result(name, result)
    _print_ours(result)
    print(f"\nwrote {path}")
    print({k: v for k, v in result.items() if k.startswith(("transformers", "speedup"))})


def _transformers_in_subprocess(timeout_s: int = 240) -> dict:
    """transformers' batched offloaded decode in a child process (a run past ``timeout_s``
    or killed for host memory ends cleanly): all requests at the GPU cap, then uncapped,
    then, if the host cannot hold their padded cache, the first half and quarter of them."""
    import json
    import subprocess

    found = {}
    tries = [(CAP_GIB, len(LENGTHS)), (0, len(LENGTHS)), (0, len(LENGTHS) // 2), (0, 2)]
    for cap, num in tries:
        key = f"transformers_offload_cap_{cap}_batch_{num}"
        command = [sys.executable, __file__, "--transformers", str(cap), str(num)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            found[key] = f"no decode step within {timeout_s} s"
            continue
        lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
        row = json.loads(lines[-1]) if lines else {"error": done.stderr.strip()[-300:]}
        if "transformers_offload_tok_s" in row:
            return {**found, **row, "transformers_gpu_cap_gib": cap or None}
        killed = " (killed: host memory)" if done.returncode == -9 else ""
        found[key] = f"{row.get('error') or 'no output'}{killed}"
    return found


def _transformers_child(cap: int, num_requests: int) -> None:
    import json

    try:
        with gpu_cap(cap or None):
            print(json.dumps(transformers_offload(LENGTHS[:num_requests])), flush=True)
    except torch.OutOfMemoryError as error:
        print(json.dumps({"error": f"out of GPU memory: {str(error)[:160]}"}), flush=True)


def _print_ours(result: dict) -> None:
    for row in result["requests"]:
        print(f"{row['prompt_tokens']:>7} tokens: decode {row['decode_ms']:7.1f} ms/token "
              f"(PCIe floor {row['pcie_floor_ms']:6.1f})  {row['summary']}")  # fmt: skip
    ratio = result["ratio_vs_batch_pcie_floor"]
    print(f"aggregate decode {result['aggregate_decode_tok_s']:.1f} tok/s; streamed decode vs "
          f"PCIe floor {ratio if ratio is None else round(ratio, 2)}; peak reserved "
          f"{result['peak_reserved_gib']:.2f} GiB (budget 23, cap 24); outputs equal single: "
          f"{result['outputs_equal_single']}; wall {result['wall_seconds']:.0f} s")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--transformers":
        _transformers_child(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()

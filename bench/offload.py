"""Head-wise offload on a GPU capped at 24 GiB: prefill and decode vs the resident run.

    PYTHONPATH=src python bench/offload.py [--lengths 32768,131072]

Llama-3-8B architecture, random bf16 weights. Writes bench/results/offload_<...>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    LLAMA3_8B,
    batch_engine,
    environment,
    pinned_h2d_bandwidth,
    prefill_once,
    random_model,
    write_result,
)
from headspace.engine.config import EngineConfig  # noqa: E402

CAP_GIB = 24
CHUNK = 8192


def measure(model, length: int, offload: str, budget: str | None, steps: int) -> dict:
    """Prefill tok/s and decode ms/token at ``length``, after a warm-up that compiles."""
    from headspace.engine.scheduler import Sequence

    max_context = length + steps + 8
    config = EngineConfig(device="cuda", offload=offload, gpu_memory=budget, prefill_chunk=CHUNK,
                          max_context=max_context, prefix_caching=False)  # fmt: skip
    engine = batch_engine(model, config, max_context=max_context)
    ids = torch.randint(0, LLAMA3_8B["vocab_size"], (length,)).tolist()
    prefill_once(engine, ids[: 2 * CHUNK])  # compiles the chunk and prefix shapes
    runner = engine.runner
    seq = Sequence(1, ids, max_context)
    runner.blocks.allocate_prompt(seq.seq_id, ids, reuse=False)
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.synchronize()
    start = time.perf_counter()
    logits = runner.prefill(seq, CHUNK)
    seq.output_ids.append(int(logits.argmax()))
    prefill_s = time.perf_counter() - start
    runner.decode([seq])  # warm-up step
    seq.output_ids.append(1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        seq.output_ids.append(int(runner.decode([seq])[0].argmax()))
    decode_s = (time.perf_counter() - start) / steps
    plan = engine.plan
    row = {
        "prefill_tok_s": length / prefill_s,
        "decode_ms": 1000 * decode_s,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
        "head_map": plan.head_map.summary() if plan else "all resident",
        "streamed_bytes_per_token": plan.memory["host_kv"] if plan else 0,
    }
    runner.blocks.free(seq.seq_id)
    del engine, runner
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="65536,131072")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    env = environment()
    h2d = pinned_h2d_bandwidth()
    model = random_model(LLAMA3_8B)
    rows = {}
    for length in [int(n) for n in args.lengths.split(",")]:
        resident = measure(model, length, "none", None, args.steps)
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(CAP_GIB * 2**30 / total)
        head = measure(model, length, "head", f"{CAP_GIB - 2}GiB", args.steps)
        torch.cuda.set_per_process_memory_fraction(1.0)
        floor_ms = 1000 * head["streamed_bytes_per_token"] / h2d
        rows[str(length)] = {"none": resident, "head": head, "pcie_floor_ms": floor_ms}
        print(
            f"{length:>8}: prefill {resident['prefill_tok_s']:.0f} -> {head['prefill_tok_s']:.0f} "
            f"tok/s (overhead {resident['prefill_tok_s'] / head['prefill_tok_s'] - 1:.1%}); "
            f"decode {resident['decode_ms']:.1f} -> {head['decode_ms']:.1f} ms "
            f"(PCIe floor {floor_ms:.1f} ms, ratio {head['decode_ms'] / max(floor_ms, 1e-9):.2f}); "
            f"peak GPU {head['peak_gpu_gib']:.1f} GiB; {head['head_map']}"
        )
    result = {
        "env": env,
        "config": LLAMA3_8B,
        "gpu_cap_gib": CAP_GIB,
        "pinned_h2d_bytes_per_s": h2d,
        "prefill_tok_s": {n: r["head"]["prefill_tok_s"] for n, r in rows.items()},
        "prefill_offload_overhead": {
            n: r["none"]["prefill_tok_s"] / r["head"]["prefill_tok_s"] - 1 for n, r in rows.items()
        },
        "decode_ms": {n: r["head"]["decode_ms"] for n, r in rows.items()},
        "decode_ratio_vs_pcie_floor": {
            n: r["head"]["decode_ms"] / r["pcie_floor_ms"]
            for n, r in rows.items()
            if r["pcie_floor_ms"] > 0
        },
        "runs": rows,
    }
    gpu = env["gpu"].replace("NVIDIA ", "").split()[0].lower()
    print("wrote", write_result(f"offload_llama3-8b_{gpu}_{env['date']}.json", result))


if __name__ == "__main__":
    main()

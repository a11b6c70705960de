"""One rank's share of a head-parallel decode step, on one GPU: the Llama-3.1-8B
architecture with random bf16 weights, sharded for rank 0 of 1, 2 and 4 (uniform heads, its
MLP slice, embeddings and LM head whole), one token through every layer and the LM head as a
CUDA graph, with the layer blocks eager (how sharded layers ran before), compiled with
Inductor's defaults, and tuned (max-autotune: the engine's decode default, ``tune_decode``).
Attention and the all-reduces are left out (an identity stands in for each), so what is
timed is the weights' GEMVs and the small kernels between them, against the weights' bytes
at the device copy bandwidth measured in the same run.

    PYTHONPATH=src python bench/profiles/rank_step.py [--worlds 1 2 4]
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent.parent))
from common import (  # noqa: E402
    LLAMA31_8B,
    environment,
    gpu_tag,
    graph_seconds,
    measure_hbm_bandwidth,
    random_model,
    write_result,
)
from headspace.parallel.shard import shard_model  # noqa: E402
from headspace.planner.head_map import HeadMap  # noqa: E402


def _passthrough(layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return q  # attention left out: its output has q's shape


def sharded_model(world: int):
    """The model as rank 0 of ``world`` keeps it (uniform heads), sums left out."""
    model = random_model(LLAMA31_8B)
    if world > 1:
        cfg = model.config
        per_rank = cfg.num_kv_heads // world
        head_map = HeadMap.all_gpu(cfg.num_layers, cfg.num_kv_heads)
        heads = [list(range(per_rank))] * cfg.num_layers
        shard_model(model, head_map, 0, world, lambda t: t, heads=heads)
        torch.cuda.empty_cache()
    return model


def kernels_per_step(fn) -> int:
    """GPU kernels one eager call of ``fn`` launches."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def measure(world: int, copy_bytes_per_s: float) -> list[dict]:
    """Per blocks mode: ms per step (graph), kernels per step, the HBM floor."""
    model = sharded_model(world)
    ids = torch.zeros(1, dtype=torch.long, device="cuda")
    positions = torch.full((1,), 4096, dtype=torch.long, device="cuda")
    embed = model.embed_tokens.weight.nbytes
    weight_bytes = sum(p.nbytes for p in model.parameters()) - embed  # one embedding row read
    floor_ms = weight_bytes / copy_bytes_per_s * 1000
    rows = []
    for mode in ("eager", "static", "tuned"):

        @torch.inference_mode()
        def step(mode=mode, model=model):
            return model.logits(model(ids, positions, _passthrough, mode))

        seconds = graph_seconds(step)
        row = {"world": world, "blocks": mode, "step_ms": seconds * 1000,
               "kernels_per_step": kernels_per_step(step), "weight_gib": weight_bytes / 2**30,
               "hbm_floor_ms": floor_ms}  # fmt: skip
        rows.append(row)
        print(f"world {world} {mode}: {row['step_ms']:.3f} ms, {row['kernels_per_step']} "
              f"kernels, floor {floor_ms:.3f} ms", flush=True)  # fmt: skip
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    env = environment()
    copy_bytes_per_s = measure_hbm_bandwidth()
    rows = [row for world in args.worlds for row in measure(world, copy_bytes_per_s)]
    result = {
        "environment": env,
        "config": {
            "model": "Llama-3.1-8B architecture, random bf16 weights",
            "tokens": 1,
            "left_out": "attention and the all-reduces (identities)",
            "head_map": "uniform: rank 0 of each world keeps the first "
            "num_kv_heads / world kv heads of every layer",
        },  # fmt: skip
        "device_copy_bytes_per_s": copy_bytes_per_s,
        "rows": rows,
    }
    path = write_result(f"rank_step_llama3-8b_{gpu_tag(env)}_{env['date']}.json", result)
    print(f"\nwrote {path}\n")
    print("| ranks | blocks | step ms | kernels | HBM floor ms |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['world']} | {r['blocks']} | {r['step_ms']:.3f} | {r['kernels_per_step']} | "
              f"{r['hbm_floor_ms']:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()

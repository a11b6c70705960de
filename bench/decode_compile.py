"""What compiling the decode step's blocks costs, and what each way of compiling them gives.

    PYTHONPATH=src python bench/decode_compile.py     # one GPU, about eight minutes

Llama-3.1-8B's architecture with random bf16 weights; the decode step's 32 layers (their
compiled blocks, attention replaced by a copy of the queries) captured in a CUDA graph per
batch bucket 1, 2, 4, ..., 64, as the engine's decode graphs are. Each way of compiling runs
in a process of its own with empty compile caches (as on a fresh machine):
- ``tuned``: max-autotune once per bucket (the count of rows static);
- ``static``: Inductor's defaults, once per bucket;
- ``rows_top``: Inductor's defaults, once for a single row and once for every count past it
  (the count symbolic), the largest bucket met first, in Inductor's deterministic mode
  (kernel configurations chosen by rule): the engine's default;
- ``rows_top_timed``: the same with the configurations chosen by timing them on this GPU
  (``TORCHINDUCTOR_DETERMINISTIC=0``), the engine's default before the deterministic mode.
(A max-autotune variant of symbolic rows, measured once and removed, is in bench/NOTES.md.)
Per bucket: the first call's seconds (compile, and tuning where asked) and a graph replay's
milliseconds. Writes ``decode_compile_llama3-8b_<gpu>_<date>.json`` (to $OUT when set).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import LLAMA31_8B, environment, gpu_tag, random_model, write_result  # noqa: E402

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # (the engine's default max_batch: 64)
TOP_FIRST = (1, *reversed(BUCKETS[1:]))
VARIANTS = {"tuned": ("tuned", BUCKETS), "static": ("static", BUCKETS),
            "rows_top": ("rows", TOP_FIRST), "rows_top_timed": ("rows", TOP_FIRST)}  # fmt: skip
VARIANT_ENV = {"rows_top_timed": {"TORCHINDUCTOR_DETERMINISTIC": "0"}}  # (the engine's
# blocks leave Inductor's deterministic mode to a user who sets it: model/llama.py)


def copy_queries(layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return q.clone()  # [tokens, heads, dim]


def one_variant(name: str) -> dict:
    """In this process: the blocks of ``VARIANTS[name]``, bucket by bucket."""
    mode, order = VARIANTS[name]
    model = random_model(LLAMA31_8B)
    figures, started = {}, time.perf_counter()
    with torch.inference_mode():
        for rows in order:
            ids = torch.randint(0, 128000, (rows,), device="cuda")
            positions = torch.full((rows,), 4096, device="cuda")
            torch.cuda.synchronize()
            first = time.perf_counter()
            model(ids, positions, copy_queries, mode)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - first
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                model(ids, positions, copy_queries, mode)
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                model(ids, positions, copy_queries, mode)
            for _ in range(3):
                graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            figures[rows] = {"first_call_s": compile_s, "step_ms": start.elapsed_time(end) / 20}
            print(f"{name:>15} rows {rows:>3}: first call {compile_s:6.1f} s, "
                  f"step {figures[rows]['step_ms']:.3f} ms", flush=True)  # fmt: skip
    return {"mode": mode, "order": list(order), "total_s": time.perf_counter() - started,
            "buckets": {str(k): v for k, v in sorted(figures.items())}}  # fmt: skip


def run_variant(name: str) -> dict:
    """``name`` in a fresh process over empty compile caches."""
    with tempfile.TemporaryDirectory() as caches:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{caches}/inductor",
                   TRITON_CACHE_DIR=f"{caches}/triton", **VARIANT_ENV.get(name, {}))  # fmt: skip
        out = Path(caches) / "result.json"
        subprocess.run([sys.executable, __file__, "--variant", name, "--write", str(out)],
                       env=env, check=True)  # fmt: skip
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--write")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = parser.parse_args()
    if args.variant:  # (the child)
        Path(args.write).write_text(json.dumps(one_variant(args.variant)))
        return
    env = environment()
    variants = {name: run_variant(name) for name in args.variants}
    result = {"env": env, "config": LLAMA31_8B, "buckets": list(BUCKETS), "variants": variants}
    path = write_result(f"decode_compile_llama3-8b_{gpu_tag(env)}_{env['date']}.json", result)
    print(f"\nwrote {path}\n")
    print(f"{'variant':>15} {'compile s':>10} " + " ".join(f"{b:>7}" for b in BUCKETS))
    for name, run in variants.items():
        total = sum(v["first_call_s"] for v in run["buckets"].values())
        steps = " ".join(f"{run['buckets'][str(b)]['step_ms']:7.3f}" for b in BUCKETS)
        print(f"{name:>15} {total:10.1f} {steps}   (step ms per bucket)")


if __name__ == "__main__":
    main()

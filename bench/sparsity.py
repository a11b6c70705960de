"""KV budgets on the GPU (Llama-3.1-8B architecture, random bf16 weights: speed and memory
only): decode after a long prompt with every head full against ``kv_budget=0.25`` in
per-head pages, each engine built as a user builds it (the model's context, default
options, plus the budget).

    PYTHONPATH=src python bench/sparsity.py [--contexts 131072] [--new-tokens 64]

Per context and mode: prefill seconds, decode ms per token, the K/V bytes the request holds
at its end and their share of the full KV (``kv_fraction_held``), and the decode speedup
over the full run measured in the same process (``decode_speedup_vs_full``). Also decode
attention alone (one layer, every head's rows over its kept pages against the full paged
kernel, each as a CUDA graph) and its floor: the K/V bytes over the HBM bandwidth measured
here. Writes ``sparsity_llama3-8b_<gpu>_<date>.json`` (to $OUT when set).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    LLAMA31_8B,
    cuda_time,
    environment,
    make_engine,
    measure_hbm_bandwidth,
    random_model,
    write_result,
)
from headspace.attention.entry_decode import entry_decode  # noqa: E402
from headspace.attention.triton_decode import paged_decode_attention  # noqa: E402
from headspace.engine.sampling import SamplingParams  # noqa: E402

MODES = {"full": {}, "snapkv 0.25": {"kv_budget": 0.25, "kv_policy": "snapkv"},
         "ada_snapkv 0.25": {"kv_budget": 0.25, "kv_policy": "ada_snapkv"}}  # fmt: skip
HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 128


def _ids(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, LLAMA31_8B["vocab_size"], (n,), generator=generator).tolist()


def engine_run(model, context: int, new_tokens: int, options: dict) -> dict:
    engine = make_engine(model, **options)
    params = [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)]
    prompt = context - new_tokens  # the prompt and its new tokens fit the context
    engine.generate_batch([_ids(prompt, 1)], params)  # warm-up: compiles, captures graphs
    out = engine.generate_batch([_ids(prompt, 2)], params)[0]
    stats = out.stats
    row = {"prefill_s": stats.prefill_seconds, "decode_ms": 1000 / stats.decode_tok_s,
           "kv_held_bytes": stats.kv_held_bytes, "kv_fraction_held": stats.kv_held_fraction,
           "summary": stats.summary(),
           "plan": engine.batch.runner.plan.head_map.summary()}  # fmt: skip
    del engine, out
    gc.collect()
    torch.cuda.empty_cache()
    return row


def graphed(fn):
    """``fn`` captured in a CUDA graph (launch costs out of the kernel's time): its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def attention_alone(context: int, fraction: float) -> dict:
    """One layer's decode attention: every kv head over ``context`` tokens (paged kernel)
    against per-head rows of ``fraction`` of them (entry kernel), ms and floor."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_pages = context // PAGE
    kv = torch.randn(2, KV_HEADS, num_pages * PAGE, DIM, generator=gen, device="cuda",
                     dtype=torch.bfloat16)  # fmt: skip
    q = torch.randn(1, HEADS, DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(num_pages, device="cuda", dtype=torch.int32)[None]
    lengths = torch.tensor([context], device="cuda", dtype=torch.int32)
    full = graphed(lambda: paged_decode_attention(q, kv[0], kv[1], table, lengths, PAGE))
    full_s = cuda_time(full, repeat=20)
    kept_pages = int(num_pages * fraction)
    plane = kv.view(2, -1, DIM)  # one plane: entry h owns pages h * num_pages + i
    rows = (torch.arange(KV_HEADS, device="cuda")[:, None] * num_pages
            + torch.arange(kept_pages, device="cuda")).int()  # fmt: skip
    row_lengths = torch.full((KV_HEADS,), kept_pages * PAGE, device="cuda", dtype=torch.int32)
    kept = graphed(lambda: entry_decode(q, plane[0], plane[1], rows, row_lengths, PAGE))
    kept_s = cuda_time(kept, repeat=20)
    hbm = measure_hbm_bandwidth()
    full_bytes = kv.nbytes
    return {"full_ms": 1000 * full_s, "kept_ms": 1000 * kept_s, "speedup": full_s / kept_s,
            "full_floor_ms": 1000 * full_bytes / hbm,
            "kept_floor_ms": 1000 * full_bytes * fraction / hbm, "hbm_gb_s": hbm / 1e9}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[131072])
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    model = random_model(LLAMA31_8B)
    result = {"environment": environment(), "model": "Llama-3.1-8B architecture, random bf16",
              "new_tokens": args.new_tokens, "runs": {}, "attention_alone": {}}  # fmt: skip
    for context in args.contexts:
        runs = {mode: engine_run(model, context, args.new_tokens, options)
                for mode, options in MODES.items()}  # fmt: skip
        full = runs["full"]
        full_bytes = context * 32 * KV_HEADS * 2 * DIM * 2
        for row in runs.values():
            row["decode_speedup_vs_full"] = full["decode_ms"] / row["decode_ms"]
            if row["kv_held_bytes"] is None:
                row["kv_held_bytes"] = (context + args.new_tokens) * full_bytes // context
                row["kv_fraction_held"] = 1.0
        result["runs"][str(context)] = runs
        result["attention_alone"][str(context)] = attention_alone(context, 0.25)
    env = result["environment"]
    gpu = env["gpu"].replace("NVIDIA ", "").split()[0].lower()
    path = write_result(f"sparsity_llama3-8b_{gpu}_{env['date']}.json", result)
    print(
        f"{'context':>8} {'mode':>16} {'prefill s':>9} {'decode ms':>9} {'KV held':>8} "
        f"{'speedup':>7}"
    )
    for context, runs in result["runs"].items():
        for mode, row in runs.items():
            print(
                f"{context:>8} {mode:>16} {row['prefill_s']:>9.1f} {row['decode_ms']:>9.2f} "
                f"{row['kv_fraction_held']:>8.3f} {row['decode_speedup_vs_full']:>7.2f}"
            )
    for context, row in result["attention_alone"].items():
        print(
            f"attention alone {context}: full {row['full_ms']:.3f} ms (floor "
            f"{row['full_floor_ms']:.3f}), 0.25 kept {row['kept_ms']:.3f} ms (floor "
            f"{row['kept_floor_ms']:.3f})"
        )
    print(path)


if __name__ == "__main__":
    main()

"""KV budgets and patterns on the GPU (Llama-3.1-8B architecture, random bf16 weights:
speed and memory only): a long prompt and decode with every head full against
``kv_budget=0.25`` in per-head pages and against half the heads ``streaming(4,1024)``,
``block_sparse(64)`` or ``vertical_slash(1000,6096)`` (``retrieval_heads=0.5``: the pattern
applies to the prompt; streaming heads also hold only sink and window), each engine built
as a user builds it (the model's context, or ``max_context`` beyond it, default options
plus the mode's).

    PYTHONPATH=src python bench/sparsity.py [--contexts 131072 524288] [--modes ...]

Head offload (HeadInfer, App. D): ``full head-offload`` streams every offloaded head's whole
history each step (the shared host pages), ``snapkv 0.25 head-offload`` keeps a quarter per
head and streams only the offloaded heads' kept tokens; both under the GPU budget a user of
a smaller card gives (``OFFLOAD_GPU_MEMORY``), compared with each other, each with its
streamed bytes per step and their floor at the pinned host-to-GPU bandwidth measured here.
``--modes`` picks modes (a mode is compared with the full run of its kind when that ran).

Per context and mode: prefill seconds and their speedup over full
(``prefill_speedup_vs_full``), decode ms per token (the median step, so a CUDA graph
captured during the run does not count), the K/V bytes the request holds at its end and
their share of the full KV (``kv_fraction_held``), and the decode speedup over the full run
(``decode_speedup_vs_full``), each against the full run of the same process. Also decode
attention alone (one layer, every head's rows over its kept pages against the full paged
kernel, each as a CUDA graph) and its floor: the K/V bytes over the HBM bandwidth measured
here. The patterned modes' profile ranks heads by random scores: on random weights which
heads are sparse does not change speed. Writes ``sparsity_llama3-8b_<gpu>_<date>.json`` (to
$OUT when set) after every run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    LLAMA31_8B,
    cuda_time,
    environment,
    graphed,
    make_engine,
    measure_hbm_bandwidth,
    pinned_h2d_bandwidth,
    random_model,
    write_result,
)
from headspace.attention.entry_decode import entry_decode  # noqa: E402
from headspace.attention.triton_decode import paged_decode_attention  # noqa: E402
from headspace.engine.sampling import SamplingParams  # noqa: E402
from headspace.planner.profile import Profile  # noqa: E402

MODES = {"full": {}, "snapkv 0.25": {"kv_budget": 0.25, "kv_policy": "snapkv"},
         "ada_snapkv 0.25": {"kv_budget": 0.25, "kv_policy": "ada_snapkv"},
         "streaming 0.5": {"retrieval_heads": 0.5},
         "block_sparse 0.5": {"retrieval_heads": 0.5, "sparse_pattern": "block_sparse(64)"},
         "vertical_slash 0.5": {"retrieval_heads": 0.5,
                                "sparse_pattern": "vertical_slash(1000,6096)"},
         "full head-offload": {"offload": "head"},
         "snapkv 0.25 head-offload": {"kv_budget": 0.25, "kv_policy": "snapkv",
                                      "offload": "head"}}  # fmt: skip
# the GPU budget of the head-offload modes, as a user of a smaller card gives it: the full
# KV does not fit beside the weights (16 GiB of KV at 128K, 64 GiB at 512K)
OFFLOAD_GPU_MEMORY = {131072: "24GiB", 524288: "48GiB"}
HEADS, KV_HEADS, DIM, PAGE, LAYERS = 32, 8, 128, 128, 32
SINK, WINDOW = 4, 1024  # the default sparse_pattern, streaming(4,1024)


def random_profile() -> str:
    """A profile of random retrieval scores for the model's shape, seeded: one file in the
    temporary folder, the same each call (rewritten, never another)."""
    scores = torch.rand(LAYERS, KV_HEADS, generator=torch.Generator().manual_seed(0))
    path = Path(tempfile.gettempdir()) / "headspace_bench_random_profile.json"
    Profile("random", LAYERS, KV_HEADS, scores.tolist()).save(path)
    return str(path)


def timed_decode(engine, rows: int | None = None, synchronise: bool = True) -> list[float]:
    """Seconds of each decode step the engine runs from now on (synchronised); ``rows``: only
    the steps that decode that many sequences (a batch's, once every prompt is in). Without
    ``synchronise`` the steps run as the engine runs them (the host plans a step while the
    GPU runs the one before) and each figure is the pace: the seconds from one such step's
    start to the next's."""
    times, last = [], [None]

    def timed(seq_ids, step):
        counted = rows is None or len(seq_ids) == rows
        if not synchronise:
            now = time.perf_counter()
            if counted and last[0] is not None:
                times.append(now - last[0])
            last[0] = now if counted else None
            return step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = step()
        torch.cuda.synchronize()
        if counted:
            times.append(time.perf_counter() - start)
        return result

    engine.lanes.hooks.decode_hooks.append(timed)  # (every lane's decode steps)
    return times


def _ids(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, LLAMA31_8B["vocab_size"], (n,), generator=generator).tolist()


def streamed_bytes(engine, context: int, lane: str) -> int:
    """K/V bytes the last decode step of ``lane`` copied from host pages: the offloaded
    entries' kept tokens (per-head pages), else every offloaded entry's whole history."""
    runner = engine.lanes.lane(lane).runner
    staging = getattr(runner.tiers[0], "staging", None)
    if staging is not None:
        return staging.streamed_bytes
    return runner.plan.head_map.num_offloaded * context * 2 * DIM * 2


def engine_run(model, context: int, new_tokens: int, options: dict, warmup: str) -> dict:
    if context > LLAMA31_8B["max_position_embeddings"]:
        options = {**options, "max_context": context}  # as a user asks for a longer one
    if options.get("offload") == "head":
        options = {**options, "gpu_memory": OFFLOAD_GPU_MEMORY.get(context, "24GiB")}
    engine = make_engine(model, **options)
    params = [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)]
    prompt = context - new_tokens  # the prompt and its new tokens fit the context
    # the full prompt once (compiles, and builds cuDNN's plan per prefix length), or two
    # chunks and a bit (compiles only: the first mode's prefill then builds the plans)
    short = min(prompt, 2 * engine.lanes.chunk + 1)
    engine.generate_batch([_ids(prompt if warmup == "full" else short, 1)], params)
    steps = timed_decode(engine)
    torch.cuda.reset_peak_memory_stats()
    out = engine.generate_batch([_ids(prompt, 2)], params)[0]
    peak = {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}  # fmt: skip
    stats = out.stats
    row = {"prefill_s": stats.prefill_seconds, "decode_ms": 1000 * statistics.median(steps),
           "decode_ms_mean": 1000 / stats.decode_tok_s, "kv_held_bytes": stats.kv_held_bytes,
           "kv_fraction_held": stats.kv_held_fraction, "summary": stats.summary(),
           "plan": engine.load().lane(stats.lane).plan.head_map.summary(),
           "offloaded_entries": engine.load().lane(stats.lane).plan.head_map.num_offloaded,
           "streamed_bytes_per_step": streamed_bytes(engine, context, stats.lane),
           "gpu_memory": options.get("gpu_memory"), **peak}  # fmt: skip
    del engine, out
    gc.collect()
    torch.cuda.empty_cache()
    return row


def attention_alone(context: int, kept_tokens: list[int]) -> dict:
    """One layer's decode attention: every kv head over ``context`` tokens (paged kernel)
    against per-head rows of ``kept_tokens [kv heads]`` (entry kernel), ms and floors."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_pages = context // PAGE
    kv = torch.randn(2, KV_HEADS, num_pages * PAGE, DIM, generator=gen, device="cuda",
                     dtype=torch.bfloat16)  # fmt: skip
    q = torch.randn(1, HEADS, DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(num_pages, device="cuda", dtype=torch.int32)[None]
    lengths = torch.tensor([context], device="cuda", dtype=torch.int32)
    full = graphed(lambda: paged_decode_attention(q, kv[0], kv[1], table, lengths, PAGE))
    full_s = cuda_time(full, repeat=20)
    plane = kv.view(2, -1, DIM)  # one plane: entry h owns pages h * num_pages + i
    width = -(-max(kept_tokens) // PAGE)
    rows = (torch.arange(KV_HEADS, device="cuda")[:, None] * num_pages
            + torch.arange(width, device="cuda")).int()  # fmt: skip
    row_lengths = torch.tensor(kept_tokens, device="cuda", dtype=torch.int32)
    kept = graphed(lambda: entry_decode(q, plane[0], plane[1], rows, row_lengths, PAGE))
    kept_s = cuda_time(kept, repeat=20)
    hbm = measure_hbm_bandwidth()
    full_bytes, fraction = kv.nbytes, sum(kept_tokens) / (KV_HEADS * context)
    return {"full_ms": 1000 * full_s, "kept_ms": 1000 * kept_s, "speedup": full_s / kept_s,
            "kept_fraction": fraction, "full_floor_ms": 1000 * full_bytes / hbm,
            "kept_floor_ms": 1000 * full_bytes * fraction / hbm, "hbm_gb_s": hbm / 1e9}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[131072])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--warmup", choices=("full", "short"), default="full",
                        help="warm-up: the full prompt, or two chunks (long contexts)")  # fmt: skip
    args = parser.parse_args()
    model = random_model(LLAMA31_8B)
    profile = random_profile()
    result = {"environment": environment(), "model": "Llama-3.1-8B architecture, random bf16",
              "new_tokens": args.new_tokens, "warmup": args.warmup, "runs": {},
              "attention_alone": {}}  # fmt: skip
    env = result["environment"]
    result["pcie_gb_s"] = pinned_h2d_bandwidth() / 1e9
    name = f"sparsity_llama3-8b_{env['gpu'].replace('NVIDIA ', '').split()[0].lower()}"
    path = Path(f"{name}_{env['date']}.json")
    for context in args.contexts:
        runs = result["runs"].setdefault(str(context), {})
        for mode in sorted(args.modes, key=lambda m: ("full" not in m, "offload" in m)):
            patterned = "retrieval_heads" in MODES[mode]
            options = {**MODES[mode], **({"profile": profile} if patterned else {})}
            runs[mode] = row = engine_run(model, context, args.new_tokens, options, args.warmup)
            # against the full run of the same kind (streaming everything, for offload)
            base = runs.get("full head-offload" if "head-offload" in mode else "full", row)
            row["decode_speedup_vs_full"] = base["decode_ms"] / row["decode_ms"]
            row["prefill_speedup_vs_full"] = base["prefill_s"] / row["prefill_s"]
            if row["offloaded_entries"]:  # the PCIe floor of its streamed bytes
                row["pcie_gb_s"] = result["pcie_gb_s"]
                row["pcie_floor_ms"] = (
                    1000 * row["streamed_bytes_per_step"] / (result["pcie_gb_s"] * 1e9)
                )
            if row["kv_held_bytes"] is None:
                full_bytes = LAYERS * KV_HEADS * 2 * DIM * 2 * (context + args.new_tokens)
                row["kv_held_bytes"], row["kv_fraction_held"] = full_bytes, 1.0
            print(context, mode, {k: v for k, v in row.items() if k != "plan"}, flush=True)
            path = write_result(path.name, result)
        half = KV_HEADS // 2
        result["attention_alone"][str(context)] = {
            "budget 0.25": attention_alone(context, [context // 4] * KV_HEADS),
            "streaming 0.5": attention_alone(context, [context] * half + [SINK + WINDOW] * half),
        }  # fmt: skip
        path = write_result(path.name, result)
    print(f"{'context':>8} {'mode':>18} {'prefill s':>9} {'x full':>6} {'decode ms':>9} "
          f"{'x full':>6} {'KV held':>8}")  # fmt: skip
    for context, runs in result["runs"].items():
        for mode, row in runs.items():
            prefill, decode = row["prefill_speedup_vs_full"], row["decode_speedup_vs_full"]
            held = row["kv_fraction_held"]
            print(f"{context:>8} {mode:>18} {row['prefill_s']:>9.1f} {prefill:>6.2f} "
                  f"{row['decode_ms']:>9.2f} {decode:>6.2f} {held:>8.3f}")  # fmt: skip
    for context, rows in result["attention_alone"].items():
        for mode, row in rows.items():
            print(f"attention alone {context} {mode}: full {row['full_ms']:.3f} ms (floor "
                  f"{row['full_floor_ms']:.3f}), kept {row['kept_fraction']:.3f}: "
                  f"{row['kept_ms']:.3f} ms (floor {row['kept_floor_ms']:.3f})")  # fmt: skip
    print(path)


if __name__ == "__main__":
    main()

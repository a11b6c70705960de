"""HGCA's GPU window kept in GPU pages against staging it from host pages every step: decode
at 128K and 512K on Llama-3.1-8B with random bf16 weights, the GPU capped at 24 GiB (23 GiB
budget), in one run.

    PYTHONPATH=src python bench/hybrid_window.py [--lengths 128 512] [--steps 6] [--sharpen 3.5]

For each length and each exact hybrid mode (``hybrid_cpu``: the CPU attends all before the
window; ``hybrid_split``: the default split by the CPU's and PCIe's rates), an engine built
as a user builds it with ``window_on_gpu`` off (*before*: the window staged every step) and
on (*after*, the default), and head streaming beside them, each over a sequence whose pages
are allocated without a prefill (an exact decode step's work does not depend on the values
in its pages). Per step: the KV copied from host pages to the GPU (``pcie_bytes_per_step``;
the query and the CPU's ``(out, lse)`` add kilobytes), and the median decode step against
the same-run PCIe floor of streaming every offloaded head (``speedup_vs_pcie_floor``). Then
the sparse mode (``cpu_sparsity=1``, default query blocks) at 128K through a real prefill
beside the exact mode it thins (``hybrid_cpu``), with the share of CPU-side tokens kept, on
keys scaled by ``--sharpen`` (on random weights every token passes the threshold for some
query, so the mode would keep all), beside its perplexity change on the embedded model (the
committed CPU result). Writes ``hybrid_window_<gpu>_<date>.json`` (to $OUT when set);
``--lengths`` with no value runs the sparse part alone, into ``hybrid_window_sparse_...``.
"""

from __future__ import annotations

import argparse
import csv
import gc
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    LLAMA31_8B,
    environment,
    gpu_tag,
    make_engine,
    pinned_h2d_bandwidth,
    random_model,
    sharpen_heads,
    write_result,
)
from headspace.engine.hooks import EngineHooks  # noqa: E402
from headspace.engine.sampling import SamplingParams  # noqa: E402
from headspace.tiers.cpu_timings import CpuTimings  # noqa: E402
from hybrid import BUDGET, CAP_GIB, MODES, _prompt, long_decode  # noqa: E402
from offload_runs import gpu_cap, warm_up  # noqa: E402
from sparsity import timed_decode  # noqa: E402

K = 1024
WINDOW = {"before": {"window_on_gpu": False}, "after": {}}
SPARSE_BETA = 1.0
PPL_FILE = Path(__file__).parent / "results" / "ppl_hybrid_sparse_smollm2-135m_cpu.csv"


def exact_rows(model, length: int, steps: int, h2d: float) -> dict:
    """Head streaming, then each exact hybrid mode before and after, at ``length``."""
    rows = {"stream": long_decode(model, "stream", length, h2d, steps)}
    for mode in ("hybrid_cpu", "hybrid_split"):
        for when, extra in WINDOW.items():
            rows[f"{mode}_{when}"] = long_decode(model, mode, length, h2d, steps, **extra)
            torch.cuda.empty_cache()
    return rows


def sparse_rows(model, h2d: float, sharpen: float, tokens: int = 24) -> dict:
    """The sparse mode at 128K through a real prefill beside the exact mode it thins (the CPU
    attends all before the window), both with the window on the GPU, on ``model`` with every
    kv head's keys scaled by ``sharpen`` (restored after): random weights attend so evenly
    that the most any of the prompt's last queries gives a token passes the uniform weight
    for nearly every token, and the mode would keep them all. Each decode step timed
    (synchronised); ``decode_ms`` is their median (the first steps attend densely and box
    the prompt's keys); ``tables_ms`` each call of the selector's host work (one a layer)."""
    saved = [layer.qkv_proj.weight.detach().cpu() for layer in model.layers]
    sharpen_heads(model, [sharpen, sharpen])
    MODES["sparse"] = {"offload": "hybrid", "cpu_sparsity": SPARSE_BETA}
    rows = {}
    try:
        for mode in ("hybrid_cpu", "sparse"):
            rows[mode] = _timed_run(model, mode, h2d, tokens)
            gc.collect()  # the engine's cycles hold its arena until collected
            torch.cuda.empty_cache()
    finally:
        with torch.no_grad():
            for layer, weight in zip(model.layers, saved, strict=True):
                layer.qkv_proj.weight.copy_(weight)
    return rows


def _timed_run(model, mode: str, h2d: float, tokens: int) -> dict:
    """One engine of ``mode``: warm-up, then a 128K prompt and ``tokens`` tokens, each decode
    step timed."""
    timings, length, cfg = CpuTimings(), 128 * K - 64, model.config
    engine = make_engine(model, EngineHooks(cpu_timings=timings), gpu_memory=BUDGET,
                         **MODES[mode])  # fmt: skip
    warm_up(engine, length, length + tokens, 2 * K, cfg.vocab_size)
    timings.clear()
    steps_s = timed_decode(engine)
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    out = engine.generate_batch([_prompt(length, 0)], [params])[0]
    steps_ms = [1000 * t for t in steps_s]
    kv_bytes = 2 * length * cfg.head_dim * model.embed_tokens.weight.element_size()
    floor_ms = 1000 * out.stats.num_hybrid_heads * kv_bytes / h2d
    engine.lanes.hooks.decode_hooks.clear()  # the timer
    return {
        "decode_ms": statistics.median(steps_ms), "step_ms": steps_ms,
        "pcie_floor_ms": floor_ms,
        "speedup_vs_pcie_floor": floor_ms / statistics.median(steps_ms),
        "tables_ms_per_step": 1000 * sum(timings.tables) / len(steps_ms),
        "tables_ms": [1000 * t for t in timings.tables],
        "cpu_kept_fraction_min_median_max": out.stats.cpu_kept_fraction,
        "plan": engine.load().lane(out.stats.lane).plan.head_map.summary(),
        "summary": out.stats.summary(),
    }  # fmt: skip


def perplexity_change(beta: float) -> dict:
    """The embedded model's committed perplexity change under the sparse mode at ``beta``
    with the default query blocks (what the GPU run measures), by (text, context)."""
    from headspace.engine.config import OffloadConfig

    mode = f"hybrid-sparse:{beta:g}+query_blocks:{OffloadConfig().cpu_query_blocks}"
    with PPL_FILE.open() as f:
        rows = [row for row in csv.DictReader(f) if row["mode"] == mode]
    return {f"{row['text']}@{row['context']}": row["delta_vs_none"] for row in rows}


def summarise(result: dict) -> None:
    """The issue's keys: per length and mode, before and after."""
    for key, field in (("pcie_bytes_per_step", "staged_bytes_per_step"),
                       ("speedup_vs_pcie_floor", "speedup_vs_pcie_floor"),
                       ("decode_ms", "decode_ms")):  # fmt: skip
        result[key] = {
            label: {mode: {when: rows[f"{mode}_{when}"][field] for when in WINDOW}
                    for mode in ("hybrid_cpu", "hybrid_split")}
            for label, rows in result["runs"].items()
        }  # fmt: skip
        for label, rows in result["runs"].items():
            result[key][label]["stream"] = rows["stream"][field]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="*", default=[128, 512],
                        help="contexts in K tokens")  # fmt: skip
    parser.add_argument("--steps", type=int, default=6, help="decode steps timed per run")
    parser.add_argument("--no-sparse", action="store_true", help="skip the sparse mode")
    parser.add_argument(
        "--sharpen",
        type=float,
        default=3.5,
        help="the sparse runs' key scale (random weights attend evenly)",
    )
    args = parser.parse_args()
    env = environment()
    h2d = pinned_h2d_bandwidth()
    result = {"env": env, "config": LLAMA31_8B, "budget": BUDGET, "gpu_cap_gib": CAP_GIB,
              "h2d_bytes_per_s": h2d, "runs": {}}  # fmt: skip
    part = "" if args.lengths else "_sparse"  # the sparse part alone: a file of its own
    name = f"hybrid_window{part}_{gpu_tag(env)}_{env['date']}.json"
    model = random_model(LLAMA31_8B)
    with gpu_cap(CAP_GIB):
        for length in args.lengths:
            label = f"{length}K"
            result["runs"][label] = exact_rows(model, length * K - 64, args.steps, h2d)
            summarise(result)
            write_result(name, result)
            _print(result)
        if not args.no_sparse:
            rows = sparse_rows(model, h2d, args.sharpen)
            speedup = rows["hybrid_cpu"]["decode_ms"] / rows["sparse"]["decode_ms"]
            result["sparse"] = {"beta": SPARSE_BETA, "keys_sharpened": args.sharpen,
                                "at_128K": rows, "speedup_vs_exact": speedup,
                                "perplexity_change_embedded_cpu": perplexity_change(
                                    SPARSE_BETA)}  # fmt: skip
            write_result(name, result)
    _print(result)


def _print(result: dict) -> None:
    print(f"\n{'run':>5} {'mode':>20} {'ms/token':>9} {'x floor':>8} {'staged MB/step':>15}  heads")
    for label, rows in result["runs"].items():
        for mode, row in rows.items():
            staged_mb = row["staged_bytes_per_step"] / 1e6
            print(f"{label:>5} {mode:>20} {row['decode_ms']:>9.1f} "
                  f"{row['speedup_vs_pcie_floor']:>8.2f} {staged_mb:>15.1f}"
                  f"  {row['gpu_heads']} gpu / {row['offloaded_heads']} offloaded")  # fmt: skip
    for mode, row in result.get("sparse", {}).get("at_128K", {}).items():
        print(f"128K {mode} (beta {SPARSE_BETA:g}): {row['decode_ms']:.1f} ms/token, "
              f"x{row['speedup_vs_pcie_floor']:.2f} floor, kept "
              f"{row['cpu_kept_fraction_min_median_max']}")  # fmt: skip


if __name__ == "__main__":
    main()

"""HGCA's GPU window kept in GPU pages against staging it from host pages every step: decode
at 128K and 512K on Llama-3.1-8B with random bf16 weights, the GPU capped at 24 GiB (23 GiB
budget), in one run.

    PYTHONPATH=src python bench/hybrid_window.py [--lengths 128 512] [--steps 6]

For each length and each exact hybrid mode (``hybrid_cpu``: the CPU attends all before the
window; ``hybrid_split``: the default split by the CPU's and PCIe's rates), an engine built
as a user builds it with ``window_on_gpu`` off (*before*: the window staged every step) and
on (*after*, the default), and head streaming beside them, each over a sequence whose pages
are allocated without a prefill (an exact decode step's work does not depend on the values
in its pages). Per step: the KV copied from host pages to the GPU (``pcie_bytes_per_step``;
the query and the CPU's ``(out, lse)`` add kilobytes), and the median decode step against
the same-run PCIe floor of streaming every offloaded head (``speedup_vs_pcie_floor``). Then
the sparse mode (``cpu_sparsity=1``) at 128K through a real prefill, before and after, with
the share of CPU-side tokens kept, beside its perplexity change on the embedded model (the
committed CPU result). Writes ``hybrid_window_<gpu>_<date>.json`` (to $OUT when set).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    LLAMA31_8B,
    environment,
    gpu_tag,
    pinned_h2d_bandwidth,
    random_model,
    write_result,
)
from hybrid import BUDGET, CAP_GIB, MODES, long_decode, run_mode  # noqa: E402
from offload_runs import gpu_cap  # noqa: E402

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


def sparse_rows(model, h2d: float) -> dict:
    """The sparse mode at 128K through a real prefill, before and after."""
    rows = {}
    for when, extra in WINDOW.items():
        MODES[f"sparse_{when}"] = {"offload": "hybrid", "cpu_sparsity": SPARSE_BETA, **extra}
        row = run_mode(model, f"sparse_{when}", [128 * K - 64], h2d)
        rows[when] = {k: v for k, v in row.items() if k != "tokens"}
        torch.cuda.empty_cache()
    return rows


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
    args = parser.parse_args()
    env = environment()
    h2d = pinned_h2d_bandwidth()
    result = {"env": env, "config": LLAMA31_8B, "budget": BUDGET, "gpu_cap_gib": CAP_GIB,
              "h2d_bytes_per_s": h2d, "runs": {}}  # fmt: skip
    name = f"hybrid_window_{gpu_tag(env)}_{env['date']}.json"
    model = random_model(LLAMA31_8B)
    with gpu_cap(CAP_GIB):
        for length in args.lengths:
            label = f"{length}K"
            result["runs"][label] = exact_rows(model, length * K - 64, args.steps, h2d)
            summarise(result)
            write_result(name, result)
            _print(result)
        if not args.no_sparse:
            change = perplexity_change(SPARSE_BETA)
            result["sparse"] = {"beta": SPARSE_BETA, "at_128K": sparse_rows(model, h2d),
                                "perplexity_change_embedded_cpu": change}  # fmt: skip
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
    for when, row in result.get("sparse", {}).get("at_128K", {}).items():
        print(f"sparse beta {SPARSE_BETA:g} {when}: {row['decode_ms']:.1f} ms/token, "
              f"x{row['speedup_vs_pcie_floor']:.2f} floor, kept "
              f"{row['cpu_kept_fraction_min_median_max']}")  # fmt: skip


if __name__ == "__main__":
    main()

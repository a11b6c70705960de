"""Hybrid GPU-CPU attention against head streaming: decode at 128K on Llama-3.1-8B with
random bf16 weights, the GPU capped at 24 GiB (23 GiB budget), in one run.

    PYTHONPATH=src python bench/hybrid.py [--batch] [--sparse 0.25 0.5 1] [--long]
    PYTHONPATH=src python bench/hybrid.py --search 128 512 [--shares 0.4 0.5]

Modes, each an engine built as a user builds it (the model's context, default options but
the one named): ``stream`` (``offload="head"``: offloaded heads stream over PCIe; the
default ``auto`` picks the hybrid tier here, recorded as ``auto_picks``), ``hybrid_cpu``
(``offload="hybrid", cpu_share=1``: the CPU attends everything before the GPU window) and
``hybrid_split`` (``offload="hybrid"``: the history splits between PCIe and the CPU at a
share searched from the decode steps' times, starting at their rates' balance). Measured in
the same run: the pinned host-to-device bandwidth (the PCIe floor of the offloaded heads),
the host's read bandwidth, the CPU kernel alone and torch's CPU SDPA. ``--batch`` adds four
concurrent 128K requests (stream vs hybrid_split); ``--sparse`` the sparse hybrid
(``cpu_sparsity=beta``) at 128K with the share of tokens kept per head (random weights
attend nearly uniformly, so these shares are far above a trained model's); ``--long`` the
exact modes' decode step at 512K, over a sequence whose pages are allocated without a
prefill (a 512K prefill takes minutes per mode; an exact decode step's work does not depend
on the values in the pages). Writes ``hybrid_llama3-8b_<gpu>_<date>.json`` (to $OUT when
set). ``--search`` runs only the searched share against fixed ones (``--shares``, and 1),
72 decode steps each at the lengths given (in K tokens, the median of the last 16), into
``hybrid_search_llama3-8b_<gpu>_<date>.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from batch_offload import _decode_window  # noqa: E402
from common import (  # noqa: E402
    LLAMA31_8B,
    environment,
    gpu_tag,
    make_engine,
    pinned_h2d_bandwidth,
    random_model,
    write_result,
)
from cpu_attention import host_read_gb_s, kernel_gb_s, torch_sdpa_gb_s  # noqa: E402
from headspace.attention.cpu_decode import kernel_isa  # noqa: E402
from headspace.engine.sampling import SamplingParams  # noqa: E402
from offload_runs import gpu_cap, warm_up  # noqa: E402

K = 1024
CAP_GIB, BUDGET = 24, "23GiB"
NEW_TOKENS = 16
MODES = {
    "stream": {"offload": "head"},
    "hybrid_cpu": {"offload": "hybrid", "cpu_share": 1.0},
    "hybrid_split": {"offload": "hybrid"},
}


def _prompt(length: int, seed: int) -> list[int]:
    rng = torch.Generator().manual_seed(seed)
    return torch.randint(0, LLAMA31_8B["vocab_size"], (length,), generator=rng).tolist()


def auto_choice(lanes, lengths: list[int]) -> str:
    """The mode ``offload="auto"`` takes for these requests under the same budget (the
    engine's own planner call, with its rates)."""
    from headspace.planner.plan import plan_batch

    pages = sum(lanes.spec.pages_for(n + NEW_TOKENS) for n in lengths)
    return plan_batch(lanes.spec, lanes.arena_bytes, pages, offload="auto",
                      hw=lanes.hardware, num_seqs=len(lengths)).offload  # fmt: skip


def run_mode(model, mode: str, lengths: list[int], h2d: float) -> dict:
    engine = make_engine(model, gpu_memory=BUDGET, **MODES[mode])
    warm_up(engine, max(lengths), max(lengths) + NEW_TOKENS, 2 * K, LLAMA31_8B["vocab_size"])
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [_prompt(n, seed) for seed, n in enumerate(lengths)]
    start = time.perf_counter()
    outs = engine.generate_batch(prompts, [params] * len(prompts))
    wall = time.perf_counter() - start
    cfg, out = model.config, outs[0]
    offloaded = out.stats.num_streamed_heads + out.stats.num_hybrid_heads
    steps = len(out.token_ids) - 1
    context = sum(lengths) + len(lengths) * NEW_TOKENS // 2
    floor_s = offloaded * 2 * context * cfg.head_dim * 2 / h2d
    decode_s = _decode_window(outs)  # requests may run together or one after another
    lane = engine.load().lane(out.stats.lane)
    return {
        "decode_ms": 1000 * decode_s / steps, "pcie_floor_ms": 1000 * floor_s,
        "speedup_vs_pcie_floor": floor_s / (decode_s / steps), "num_requests": len(outs),
        "aggregate_decode_tok_s": sum(len(o.token_ids) - 1 for o in outs) / decode_s,
        "cpu_share": lane.cpu_share,
        "gpu_window": engine.config.offload.gpu_window if lane.cpu_share is not None else None,
        "head_map_summary": out.stats.summary().split(" | ")[3], "wall_seconds": wall,
        "plan": lane.layout,
        "auto_picks": auto_choice(engine.lanes, lengths),
        "cpu_kept_fraction_min_median_max": out.stats.cpu_kept_fraction,
        "summary": out.stats.summary(), "tokens": [o.token_ids for o in outs],
    }  # fmt: skip


def long_decode(model, mode: str, length: int, h2d: float, steps: int = 4,
                budget: str = BUDGET, timed: int | None = None, **extra) -> dict:  # fmt: skip
    """Decode steps at ``length`` over freshly allocated (zero) pages, the engine built as a
    user builds it for that context (``max_context``) under ``budget`` (``extra``: options
    beside the mode's). ``decode_ms``: the median of the last ``timed`` steps (default: all
    after the first; the searched hybrid share settles over the first few dozen);
    ``cpu_shares``: each step's hybrid share. ``staged_bytes_per_step``: the KV the steps
    after the first copied from host pages to the GPU (staged, or filled into the GPU
    window), per step."""
    from headspace.engine.step_plan import Sequence

    options = {"max_context": length + 64} if length + 64 > model.config.max_context else {}
    engine = make_engine(model, gpu_memory=budget, **options, **MODES[mode], **extra)
    seq = Sequence(10**9, [0] * length, length + steps + 1)
    plan, lane = engine.lanes.prepare([seq])
    blocks, runner = lane.scheduler.blocks, lane.runner
    blocks.allocate_prompt(seq.seq_id, seq.prompt_ids, lane.scheduler.tiers, reuse=False)
    pages = blocks.pages([seq.seq_id])
    times, counters, copied, shares = [], runner.site.counters, [], []
    for step in range(steps + 1):
        blocks.append_token(seq.seq_id)
        torch.cuda.synchronize()
        start = time.perf_counter()
        runner.decode([seq.seq_id], [length + step], [0], pages)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        copied.append(counters.staged_entry_pages + counters.window_fill_pages)
        shares.append(runner.hybrid_share.step_share)
    blocks.free(seq.seq_id)
    runner.forget(seq.seq_id)
    cfg, offloaded = model.config, plan.head_map.num_offloaded
    floor_s = offloaded * 2 * length * cfg.head_dim * 2 / h2d
    last = times[1:] if timed is None else times[-timed:]
    decode_s = sorted(last)[len(last) // 2]  # the median
    staged = (copied[-1] - copied[0]) * runner.spec.entry_page_bytes / steps
    return {"decode_ms": 1000 * decode_s, "pcie_floor_ms": 1000 * floor_s,
            "speedup_vs_pcie_floor": floor_s / decode_s, "step_ms": [1000 * t for t in times],
            "offloaded_heads": offloaded, "gpu_heads": plan.head_map.count("gpu"),
            "cpu_share": runner.cpu_share, "cpu_shares": shares,
            "staged_bytes_per_step": staged,
            "gpu_window_pages": plan.gpu_window.pages if plan.gpu_window else 0}  # fmt: skip


def share_search_rows(model, h2d: float, shares: list[float], lengths: list[int],
                      steps: int = 72, timed: int = 16) -> dict:  # fmt: skip
    """The default hybrid engine (its share searched from the steps' times) against fixed
    shares, ``steps`` decode steps each at every length (tokens); ``decode_ms`` is the median
    of the last ``timed`` steps, where the search has settled."""
    runs = {}
    for length in lengths:
        rows = runs.setdefault(f"{length // K}K", {})
        for share in ["searched", *shares]:
            mode = "hybrid_split" if share == "searched" else f"hybrid_share_{share:g}"
            MODES.setdefault(mode, {"offload": "hybrid", "cpu_share": share})
            row = long_decode(model, mode, length - 64, h2d, steps, timed=timed)
            rows[mode] = row
            print(f"{length // K}K", mode, f"{row['decode_ms']:.1f} ms at share {row['cpu_share']}",
                  flush=True)  # fmt: skip
            torch.cuda.empty_cache()
    return runs


def _agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Share of greedy tokens equal to the streamed run's up to the first difference (random
    bf16 weights give near-tied logits: a different but exact summation order may flip one;
    fp32 equality of every mode is what the tests check)."""
    same, total = 0, 0
    for row, ref in zip(tokens, reference, strict=True):
        diverged = next((i for i, (a, b) in enumerate(zip(row, ref, strict=True)) if a != b),
                        len(ref))  # fmt: skip
        same, total = same + diverged, total + len(ref)
    return same / total


def cpu_kernel_figures(context: int) -> dict:
    threads = torch.get_num_threads()
    figures = {"threads": threads, "kernel_isa": kernel_isa(),
               "host_read_gb_s": host_read_gb_s(4 << 30, threads),
               "cpu_attention_gb_s": kernel_gb_s(context, 4, threads),
               "torch_cpu_sdpa_gb_s": torch_sdpa_gb_s(context, threads)}  # fmt: skip
    figures["share_of_host_read"] = figures["cpu_attention_gb_s"] / figures["host_read_gb_s"]
    return figures


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", action="store_true", help="also four 128K requests at once")
    parser.add_argument("--shares", type=float, nargs="*", default=[],
                        help="also hybrid at these CPU shares (a sweep, at 128K)")  # fmt: skip
    parser.add_argument("--sparse", type=float, nargs="*", default=[],
                        help="also sparse hybrid at these betas (at 128K)")  # fmt: skip
    parser.add_argument("--long", action="store_true", help="also the exact modes at 512K")
    parser.add_argument("--only-long", action="store_true", help="only the 512K runs")
    parser.add_argument("--search", type=int, nargs="*", default=None, metavar="K",
                        help="only the searched share against --shares (default 0.4 0.5) and "
                        "1, 72 decode steps at these lengths in K tokens (default 128 "
                        "512)")  # fmt: skip
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    if args.search is not None:
        search_main(args)
        return
    for share in args.shares:
        MODES[f"hybrid_share_{share:g}"] = {"offload": "hybrid", "cpu_share": share}
    for beta in args.sparse:
        MODES[f"hybrid_sparse_{beta:g}"] = {"offload": "hybrid", "cpu_sparsity": beta}
    env = environment()
    result = {"env": env, "config": LLAMA31_8B, "budget": BUDGET, "gpu_cap_gib": CAP_GIB,
              "new_tokens": NEW_TOKENS, "h2d_bytes_per_s": pinned_h2d_bandwidth(),
              "cpu_kernel": cpu_kernel_figures(128 * K)}  # fmt: skip
    print(result["cpu_kernel"], flush=True)
    gpu = gpu_tag(env)
    name = f"hybrid_llama3-8b_{gpu}_{env['date']}.json"
    model = random_model(LLAMA31_8B)
    length = 128 * K - 4 * NEW_TOKENS  # within the model's 128K context with its new tokens
    runs = {} if args.only_long else {"128K": [length]}
    if args.batch:
        runs["4x128K"] = [length] * 4
    with gpu_cap(CAP_GIB):
        for label, lengths in runs.items():
            for mode in MODES if len(lengths) == 1 else ("stream", "hybrid_split"):
                if args.shares and mode in ("hybrid_cpu", "hybrid_split"):
                    continue  # a sweep measures the shares it names
                row = run_mode(model, mode, lengths, result["h2d_bytes_per_s"])
                result.setdefault(label, {})[mode] = row
                print(label, mode, {k: v for k, v in row.items() if k != "tokens"}, flush=True)
                torch.cuda.empty_cache()
            rows = result[label]
            reference = rows["stream"]["tokens"]
            rows["token_agreement_with_stream"] = {
                mode: _agreement(row["tokens"], reference) for mode, row in list(rows.items())
            }
            write_result(name, result)
        if args.long or args.only_long:
            for mode in ("stream", "hybrid_cpu", "hybrid_split"):
                row = long_decode(model, mode, 512 * K, result["h2d_bytes_per_s"])
                result.setdefault("512K", {})[mode] = row
                print("512K", mode, row, flush=True)
                torch.cuda.empty_cache()
                write_result(name, result)
    _print(result)


def search_keys(runs: dict) -> dict:
    """The issue's keys over the search's ``runs``: per length and share, ``decode_ms``,
    ``speedup_vs_pcie_floor`` and ``pcie_bytes_per_step`` (KV copied from host pages)."""
    keys = {"decode_ms": "decode_ms", "speedup_vs_pcie_floor": "speedup_vs_pcie_floor",
            "pcie_bytes_per_step": "staged_bytes_per_step"}  # fmt: skip
    return {key: {label: {mode: row[field] for mode, row in rows.items()}
                  for label, rows in runs.items()}
            for key, field in keys.items()}  # fmt: skip


def search_main(args) -> None:
    """``--search``: the searched share against fixed ones (``hybrid_search_*.json``)."""
    env = environment()
    h2d = pinned_h2d_bandwidth()
    result = {"env": env, "config": LLAMA31_8B, "budget": BUDGET, "gpu_cap_gib": CAP_GIB,
              "h2d_bytes_per_s": h2d}  # fmt: skip
    model = random_model(LLAMA31_8B)
    lengths = [n * K for n in (args.search or [128, 512])]
    with gpu_cap(CAP_GIB):
        result["runs"] = share_search_rows(model, h2d, [*(args.shares or [0.4, 0.5]), 1.0],
                                           lengths)  # fmt: skip
    result.update(search_keys(result["runs"]))
    write_result(f"hybrid_search_llama3-8b_{gpu_tag(env)}_{env['date']}.json", result)
    print(f"\n{'length':>7} {'share':>14} {'ms/token':>9} {'x PCIe floor':>13}  searched shares")
    for label, rows in result["runs"].items():
        for mode, row in rows.items():
            path = " ".join(f"{s:.2f}" for s in row["cpu_shares"][::8])
            path = path if mode == "hybrid_split" else ""
            print(
                f"{label:>7} {mode.removeprefix('hybrid_'):>14} {row['decode_ms']:>9.1f} "
                f"{row['speedup_vs_pcie_floor']:>13.2f}  {path}"
            )


def _print(result: dict) -> None:
    print(f"\n{'run':>8} {'mode':>13} {'ms/token':>9} {'PCIe floor':>11} {'x floor':>8} "
          f"{'tok/s':>7}  heads")  # fmt: skip
    for label in ("128K", "4x128K"):
        for mode, row in result.get(label, {}).items():
            if isinstance(row, dict) and "decode_ms" in row:
                floor, times = row["pcie_floor_ms"], row["speedup_vs_pcie_floor"]
                print(f"{label:>8} {mode:>13} {row['decode_ms']:>9.1f} {floor:>11.1f} "
                      f"{times:>8.2f} {row['aggregate_decode_tok_s']:>7.2f}  "
                      f"{row['head_map_summary']}")  # fmt: skip
        if label in result:
            agreement = result[label]["token_agreement_with_stream"]
            print(f"{label:>8} greedy tokens as the streamed run's: {agreement}")
    for mode, row in result.get("128K", {}).items():
        if isinstance(row, dict) and row.get("cpu_kept_fraction_min_median_max"):
            print(f"{mode}: kept per head min/median/max {row['cpu_kept_fraction_min_median_max']}")
    for mode, row in result.get("512K", {}).items():
        print(f"{'512K':>8} {mode:>13} {row['decode_ms']:>9.1f} {row['pcie_floor_ms']:>11.1f} "
              f"{row['speedup_vs_pcie_floor']:>8.2f}  {row['gpu_heads']} gpu / "
              f"{row['offloaded_heads']} offloaded")  # fmt: skip
    kernel = result["cpu_kernel"]
    print(f"CPU kernel ({kernel['kernel_isa']}, {kernel['threads']} threads): "
          f"{kernel['cpu_attention_gb_s']:.1f} GB/s = {kernel['share_of_host_read']:.2f} of the "
          f"host read {kernel['host_read_gb_s']:.1f} GB/s; torch CPU SDPA "
          f"{kernel['torch_cpu_sdpa_gb_s']:.1f} GB/s")  # fmt: skip


if __name__ == "__main__":
    main()

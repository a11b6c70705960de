"""Merge the parts of the offload benchmark into one result file, two PNG plots and a table.

    python bench/offload_report.py DIR [--out bench/results]

DIR holds ``offload_part_{max,speed,long}.json`` written by ``bench/offload.py`` on one GPU
machine. A row's PCIe floor uses the bandwidth measured in its own part; offload and no
offload at 32K and 128K ran in one part, at 512K in two parts of one machine session.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LOW_BUDGET, CAP_BUDGET = "17GiB", "22GiB"
SYSTEMS = ["transformers", "transformers_offload", "none", "layer", "head"]


def load_parts(directory: Path) -> dict[str, dict]:
    parts = {}
    for path in sorted(directory.glob("offload_part_*.json")):
        data = json.loads(path.read_text())
        for row in data["rows"]:  # each row keeps the bandwidth measured beside it
            row["h2d_bytes_per_s"] = data.get("pinned_h2d_bytes_per_s")
        parts[data["part"]] = data
    return parts


def _rows(parts: dict, **match) -> list[dict]:
    rows = [r for p in parts.values() for r in p["rows"]]
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def _one(parts: dict, **match) -> dict | None:
    rows = [r for r in _rows(parts, **match) if r["ok"]]
    return rows[-1] if rows else None


def max_context(parts: dict) -> dict:
    """Per system: the longest prompt that ran (prefill + 16 decode tokens), the first that
    did not and why; for layer/head also the planner's limit on the host's memory."""
    limits = parts.get("max", {}).get("planner_limit", {})
    out = {}
    for system in SYSTEMS:
        rows = _rows(parts, system=system)
        if system == "none":  # under the cap, not the uncapped reference runs
            rows = [r for r in rows if r.get("budget") == CAP_BUDGET]
        ok = [r["length"] for r in rows if r["ok"]]
        failed = [r for r in rows if not r["ok"]]
        out[system] = {
            "tokens": max(ok) if ok else 0,
            "first_failure": min(failed, key=lambda r: r["length"])["length"] if failed else None,
            "failure": failed[0]["error"] if failed else None,
        }
        if system in limits:
            out[system]["planner_limit_tokens"] = limits[system]["tokens"]
            out[system]["host_budget_gib"] = limits[system]["host_budget_gib"]
            out[system]["refusal_beyond"] = limits[system]["refusal"]
    return out


def speeds(parts: dict) -> dict:
    """Head offload at the 17 GiB budget per length, against no offload and the PCIe floor."""
    lengths = sorted({r["length"] for r in _rows(parts, system="head", budget=LOW_BUDGET)})
    result = {k: {} for k in ("prefill_tok_s", "prefill_tok_s_no_offload",
                              "prefill_offload_overhead", "prefill_fraction_of_compute_roofline",
                              "decode_ms", "decode_ms_no_offload", "decode_pcie_floor_ms",
                              "decode_ratio_vs_pcie_floor")}  # fmt: skip
    for length in lengths:
        head = _one(parts, system="head", budget=LOW_BUDGET, length=length)
        none = _one(parts, system="none", length=length, budget=None)
        if head is None:
            continue
        key = str(length)
        floor_ms = 1000 * head["streamed_bytes_per_token"] / head["h2d_bytes_per_s"]
        result["prefill_tok_s"][key] = head["prefill_tok_s"]
        result["prefill_fraction_of_compute_roofline"][key] = (
            head["prefill_tok_s"] / head["prefill_roofline_tok_s"]
        )
        result["decode_ms"][key] = head["decode_ms"]
        result["decode_pcie_floor_ms"][key] = floor_ms
        result["decode_ratio_vs_pcie_floor"][key] = head["decode_ms"] / floor_ms
        if none is not None:
            result["prefill_tok_s_no_offload"][key] = none["prefill_tok_s"]
            overhead = none["prefill_tok_s"] / head["prefill_tok_s"] - 1
            result["prefill_offload_overhead"][key] = overhead
            result["decode_ms_no_offload"][key] = none["decode_ms"]
    return result


def plot_max_context(table: dict, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(table)
    values = [table[n]["tokens"] / 1024 for n in names]
    bars = ax.barh(names, values, color=["#999", "#999", "#4a7", "#48c", "#26a"])
    for bar, value in zip(bars, values, strict=True):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f"{value:.0f}K ",
                va="center", ha="right", color="white", fontweight="bold")  # fmt: skip
    for y, name in enumerate(names):  # how far the planner would go on this host's RAM
        limit = table[name].get("planner_limit_tokens")
        if limit:
            ax.plot([limit / 1024], [y], "k|", markersize=18)
            ax.text(
                limit / 1024,
                y,
                f"  planner limit\n  {limit // 1024}K at 22 GiB",
                fontsize=7,
                va="center",
            )
    ax.set_xscale("log", base=2)
    ax.set_xlim(left=8, right=max(values) * 8)
    ax.set_xlabel("longest prompt run (K tokens, prefill + 16 decode tokens)")
    ax.set_title("Llama-3-8B (random bf16), GPU capped at 24 GiB")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_speed(parts: dict, path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    series = [("no offload (uncapped)", dict(system="none", budget=None)),
              ("head, 17 GiB budget", dict(system="head", budget=LOW_BUDGET)),
              ("head, 22 GiB budget", dict(system="head", budget=CAP_BUDGET)),
              ("layer, 22 GiB budget", dict(system="layer", budget=CAP_BUDGET))]  # fmt: skip
    for label, match in series:
        rows = sorted((r for r in _rows(parts, **match) if r["ok"] and "decode_ms" in r),
                      key=lambda r: r["length"])  # fmt: skip
        rows = [r for r in rows if r["length"] >= 32768]
        if not rows:
            continue
        x = [r["length"] / 1024 for r in rows]
        left.plot(x, [r["prefill_tok_s"] for r in rows], "o-", label=label)
        right.plot(x, [r["decode_ms"] for r in rows], "o-", label=label)
        if match["system"] == "head" and match["budget"] == LOW_BUDGET:
            floor = [1000 * r["streamed_bytes_per_token"] / r["h2d_bytes_per_s"] for r in rows]
            right.plot(x, floor, "k--", label="PCIe floor (17 GiB plan)")
    for ax, title in ((left, "prefill tokens/s"), (right, "decode ms/token")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (K tokens)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    right.set_yscale("log")
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    parts = load_parts(args.directory)
    env = next(iter(parts.values()))["env"]
    budgets = {"head": LOW_BUDGET, "layer": CAP_BUDGET, "none": "uncapped GPU"}
    config = next(iter(parts.values()))["config"]
    result = {"env": env, "config": config, "gpu_cap_gib": 24, "budgets": budgets}
    result["max_context"] = max_context(parts)
    head_512k = _one(parts, system="head", budget=LOW_BUDGET, length=512 * 1024)
    result["peak_gpu_gib_at_512k"] = head_512k["peak_reserved_gib"] if head_512k else None
    result["peak_gpu_allocated_gib_at_512k"] = head_512k["peak_gpu_gib"] if head_512k else None
    result.update(speeds(parts))
    result["head_map_summary"] = {
        str(r["length"]): r["head_map"] for r in _rows(parts, system="head", budget=LOW_BUDGET)
        if r["ok"]
    }  # fmt: skip
    result["notes"] = (
        "One machine session, three commands (a command runs at most ten minutes): 'max' "
        "(ladders under the 24 GiB cap), 'speed' (32K/128K, no offload uncapped vs head "
        "offload capped, and the 512K no-offload reference), 'long' (512K head and layer). "
        "Prefill and decode of offloaded runs: head offload at a 17 GiB budget under the cap. "
        "peak_gpu_gib_at_512k: torch's peak reserved memory (allocated: "
        "peak_gpu_allocated_gib_at_512k). PCIe floor: streamed bytes per token / pinned H2D "
        "bandwidth measured in the row's part. planner_limit_tokens: at the 22 GiB budget."
    )
    result["parts"] = parts
    gpu = env["gpu"].replace("NVIDIA ", "").split()[0].lower()
    stem = f"offload_llama3-8b_{gpu}_{env['date']}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot_max_context(result["max_context"], args.out / f"{stem}_max_context.png")
    plot_speed(parts, args.out / f"{stem}_speed.png")
    print_table(result)


def print_table(result: dict) -> None:
    print("max context (GPU capped at 24 GiB):")
    for system, row in result["max_context"].items():
        limit = row.get("planner_limit_tokens")
        extra = f" (planner limit on this host at 22 GiB: {limit // 1024}K)" if limit else ""
        print(f"  {system:<22}{row['tokens'] // 1024:>6}K{extra}")
    print(f"peak GPU at 512K (head, 17 GiB budget): {result['peak_gpu_gib_at_512k']} GiB")
    print(f"{'context':>8}{'prefill':>9}{'no offl.':>9}{'overhead':>9}{'roofline':>9}"
          f"{'decode ms':>10}{'floor ms':>9}{'ratio':>7}")  # fmt: skip
    for key, tok_s in result["prefill_tok_s"].items():
        none = result["prefill_tok_s_no_offload"].get(key)
        overhead = result["prefill_offload_overhead"].get(key)
        print(f"{int(key) // 1024:>7}K{tok_s:>9.0f}{none or float('nan'):>9.0f}"
              f"{overhead if overhead is not None else float('nan'):>9.1%}"
              f"{result['prefill_fraction_of_compute_roofline'][key]:>9.2f}"
              f"{result['decode_ms'][key]:>10.1f}{result['decode_pcie_floor_ms'][key]:>9.1f}"
              f"{result['decode_ratio_vs_pcie_floor'][key]:>7.2f}")  # fmt: skip


if __name__ == "__main__":
    main()

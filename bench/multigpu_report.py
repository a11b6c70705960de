"""The multi-GPU benchmark's report (``bench/multigpu.py``): the issue's keys from each GPU
count's runs (imbalance per solver, throughput against uniform, scaling, the cost model's
predicted against measured attention), the table it prints and the PNG of each rank's
attention per solver."""

from __future__ import annotations

import json
from pathlib import Path

from common import MODEL_NAMES, MODELS


def imbalance(seconds: list[float] | None) -> float | None:
    """Max over mean of each rank's seconds (None where nothing was timed)."""
    return max(seconds) / (sum(seconds) / len(seconds)) if seconds and sum(seconds) else None


def step_waits(per_rank: list[list[float]]) -> float:
    """``per_rank [rank][layer]`` seconds -> what a step waits for: the sum over layers of
    the slowest rank (every layer ends in an all-reduce)."""
    return sum(map(max, zip(*per_rank, strict=True)))


def layer_imbalance(per_rank: list[list[float]]) -> float | None:
    """:func:`step_waits` over the sum of the layers' means: against perfect balance. Ranks
    even over the model can still wait at every layer."""
    mean = sum(map(sum, per_rank)) / len(per_rank)
    return step_waits(per_rank) / mean if mean else None


def phase_imbalance(attention: dict, key: str) -> float | None:
    """A phase's imbalance: per layer where the run timed layers, else of the ranks' sums."""
    if attention.get(f"{key}_layers"):
        return layer_imbalance(attention[f"{key}_layers"])
    return imbalance(attention.get(key))


PHASE_KEYS = (("prefill", "prefill"), ("decode", "decode_step"))  # attention_seconds' keys


def copies_keys(copy_cost: str | None, runs: list[dict]) -> dict:
    """``copy_cost_us`` (before/after, from ``bench/profiles/copy_cost.py``'s result) and the
    run-to-run spread of decode and prefill (``uniform-again`` over ``uniform``), where
    measured."""
    keys = {}
    if copy_cost:
        keys["copy_cost_us"] = json.loads(Path(copy_cost).read_text())["copy_cost_us"]
    by_solver = {r["solver"]: r for r in runs}
    if {"uniform", "uniform-again"} <= set(by_solver):
        again, first = by_solver["uniform-again"], by_solver["uniform"]
        keys["run_to_run_spread"] = {p: ratio(again[f"{p}_tok_s"], first[f"{p}_tok_s"])
                                     for p in ("prefill", "decode")}  # fmt: skip
    return keys


def layer_floor_tokens(placement: list[list], kept: list[list[float]]) -> float:
    """The KV tokens a decode step waits to read for one sequence: over layers, the rank
    that reads the most of that layer's entries (every layer ends in an all-reduce; a copy
    is held whole on each of its ranks and each reads its share). ``placement`` as a run
    records it (``[layer, kv head, ranks, shares]``, shares empty for a head on one rank);
    ``kept[layer][kv head]`` an entry's tokens."""
    reads: dict[int, dict[int, float]] = {}  # layer -> rank -> tokens
    for layer, kv_head, ranks, shares in placement:
        by_rank = reads.setdefault(layer, {})
        for i, rank in enumerate(ranks):
            part = kept[layer][kv_head] * (shares[i] if shares else 1.0)
            by_rank[rank] = by_rank.get(rank, 0.0) + part
    return float(sum(max(by_rank.values()) for by_rank in reads.values()))


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, None where either was not measured (a stand-in run's prefill)."""
    return None if a is None or b is None else a / b


def describe(model: str, num_layers: int | None) -> str:
    """The result's words for the model: its architecture, layers kept and weights."""
    full = MODELS[model]["num_hidden_layers"]
    layers = f" at {num_layers} of its {full} layers" if num_layers else ""
    return f"{MODEL_NAMES[model]} architecture{layers}, random bf16 weights"


def summarise(runs: dict[int, list[dict]]) -> dict:
    """The issue's keys from every GPU count's runs."""
    at_most = {r["solver"]: r for r in runs[max(runs)]}
    summary = {
        "gpus": sorted(runs),
        "imbalance_max_over_mean": {
            s: {p: phase_imbalance(at_most[s]["attention_seconds"], key) for p, key in PHASE_KEYS}
            for s in at_most
        },
        "imbalance_of_rank_totals": {
            s: {p: imbalance(at_most[s]["attention_seconds"].get(key)) for p, key in PHASE_KEYS}
            for s in at_most
        },
        "throughput_vs_uniform": {
            s: {
                p: ratio(at_most[s][f"{p}_tok_s"], at_most["uniform"][f"{p}_tok_s"])
                for p in ("prefill", "decode")
            }
            for s in at_most
            if "uniform" in at_most
        },  # fmt: skip
        "scaling": {
            n: {r["solver"]: {key: r[key] for key in ("prefill_tok_s", "decode_tok_s")} for r in rs}
            for n, rs in sorted(runs.items())
        },  # fmt: skip
        "cost_model": {s: _cost_model(r) for s, r in at_most.items() if "predicted" in r},
        "balanced_phase": {s: r.get("balanced_phase", "decode") for s, r in at_most.items()},
    }
    return summary


def _cost_model(run: dict) -> dict:
    """Predicted (roofline at the planner's rates) against measured attention seconds per
    rank: the prompt's last chunk, and one decode step at the context; the step is the sum
    over layers of the slowest rank where the run timed layers (else the slowest rank's). A
    phase the run did not time (a stand-in's prefill, a served rate's attention) is left out."""
    measured = run["attention_seconds"]
    out = {}
    for phase, key in (("prefill", "prefill_last_chunk"), PHASE_KEYS[1]):
        if key not in measured:
            continue
        predicted = run["predicted"][phase]
        layers = measured.get(f"{key}_layers")
        step = step_waits(layers) if layers else max(measured[key])
        out[phase] = {"predicted_rank_seconds": predicted["rank_seconds"],
                      "measured_rank_seconds": measured[key],
                      "predicted_step_seconds": predicted.get("step_seconds",
                                                              max(predicted["rank_seconds"])),
                      "measured_step_seconds": step}  # fmt: skip
    return out


def plot(runs: list[dict], path: Path) -> None:
    """Each rank's attention seconds per solver, prefill and decode side by side (a phase no
    run timed left out), and (a black bar across them, where the run timed layers) what the
    step waits for: the sum over layers of each layer's slowest rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [(p, k) for p, k in PHASE_KEYS if any(k in r["attention_seconds"] for r in runs)]
    if not phases:  # nothing timed (a served rate's run)
        return
    fig, axes = plt.subplots(1, len(phases), figsize=(5.75 * len(phases), 3.6), squeeze=False)
    axes = axes[0]
    for ax, (phase, key) in zip(axes, phases, strict=True):
        for i, run in enumerate(runs):
            seconds = run["attention_seconds"].get(key)
            if seconds is None:  # a phase the run did not time
                continue
            width = 0.8 / len(seconds)
            for rank, value in enumerate(seconds):
                ax.bar(i + (rank - (len(seconds) - 1) / 2) * width, value, width,
                       color=f"C{rank}", label=f"rank {rank}" if i == 0 else None)  # fmt: skip
            layers = run["attention_seconds"].get(f"{key}_layers")
            if layers:
                label = "step waits\n(each layer's slowest)" if i == 0 else None
                waits = step_waits(layers)
                ax.hlines(waits, i - 0.45, i + 0.45, colors="black", linewidth=2, label=label)
        ax.set_xticks(range(len(runs)), [r["solver"] for r in runs])
        ax.set_title(f"{phase} attention per rank" + (" (mean step)" if phase == "decode" else ""))
        ax.set_ylabel("seconds")
    axes[-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(result: dict, runs: dict[int, list[dict]]) -> None:
    print(f"{'gpus':>4} {'solver':>8} {'prefill tok/s':>14} {'decode tok/s':>13} "
          f"{'floor tok/s':>12} {'imb prefill':>12} {'imb decode':>11}")  # fmt: skip
    for n, rs in sorted(runs.items()):
        for r in rs:
            att = r["attention_seconds"]
            imb = [phase_imbalance(att, key) for _, key in PHASE_KEYS]
            imb = [f"{x:.3f}" if x is not None else "-" for x in imb]
            prefill = "-" if r["prefill_tok_s"] is None else f"{r['prefill_tok_s']:.0f}"
            floor = r.get("decode_layer_floor_tok_s")
            floor = "-" if floor is None else f"{floor:.1f}"
            print(f"{n:>4} {r['solver']:>8} {prefill:>14} "
                  f"{r['decode_tok_s']:>13.1f} {floor:>12} {imb[0]:>12} "
                  f"{imb[1]:>11}")  # fmt: skip


def predicted_loads(engine, config, world: int, batch: int) -> dict:
    """The cost model's loads (``balance_summary`` per phase) of the assignment the engine
    runs (its head map's ranks and copies' shares), prefill priced at the chunk it runs,
    decode at the run's ``batch``."""
    from headspace.engine.ranks import costed_map
    from headspace.parallel.assignment import balance_summary
    from headspace.parallel.balance import assignments_of, priced_hardware
    from headspace.planner.head_cost import CostShape, head_costs

    shape = engine.model.config
    priced = costed_map(shape, config, engine.profile, engine.max_context)
    hw = priced_hardware(config.parallel)
    assignments = assignments_of(engine.ranks.head_map)
    loads = {}
    for phase in ("prefill", "decode"):
        costs = head_costs(priced, CostShape.of(shape, config.runtime.torch_dtype.itemsize), hw,
                           phase=phase, context=engine.max_context,
                           chunk=engine.lanes.chunk, profile=engine.profile,
                           batch=batch if phase == "decode" else 1)  # fmt: skip
        loads[phase] = balance_summary(costs, assignments, world)
    return loads

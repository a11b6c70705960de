"""Re-measure the headline figure of every landed result and print it beside the committed one.

    PYTHONPATH=src python bench/regress.py        # one GPU, about six minutes
    PYTHONPATH=src python bench/regress.py --kinds offload hybrid    # some of them

Flags any drop of more than 5% (a figure measured on another GPU kind than the committed
one is shown but not judged; rows whose figure follows the host's CPU, such as the hybrid
split's, move more than that between hosts: bench/NOTES.md). Run it before resolving any
change to ``engine/``, ``attention/`` or ``kv/``; it writes ``regress_<gpu>_<date>.json``
(to $OUT when set).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    LLAMA31_8B,
    environment,
    gpu_tag,
    make_engine,
    random_model,
    write_result,
)
from headspace.engine.sampling import SamplingParams  # noqa: E402

RESULTS = Path(__file__).parent / "results"
K = 1024
DROP = 0.05  # a change past this, against the committed figure, is flagged


# the committed files each kind's figures come from (beside ``<kind>_llama3-8b_*``)
FILES = {"sparsity": ("sparsity", "sparsity_budgets", "sparsity_offload")}


def committed(kind: str, gpu: str, figure: str,
              results: Path = RESULTS) -> tuple[float, str] | tuple[None, None]:  # fmt: skip
    """The committed value of ``figure`` and its file: the newest file of ``kind`` in
    ``results`` that holds it, this GPU's if any, else another's (the file is printed beside
    the figure). Newest by the date in the name; of one date, a later stem's file, then a
    name with a suffix after the date (a later run of some of its rows)."""
    stems = FILES.get(kind, (kind,))
    files = [(_date(p.stem), order, p.name, p) for order, stem in enumerate(stems)
             for p in results.glob(f"{stem}_llama3-8b_*.json")]  # fmt: skip
    found = []
    for *_, path in sorted(files):
        value = reference(kind, json.loads(path.read_text()), figure)
        if value is not None:
            found.append((value, path.name))
    mine = [f for f in found if f"_{gpu}_" in f[1]]
    return (mine or found or [(None, None)])[-1]


def _date(stem: str) -> str:
    found = re.search(r"_(\d{4}-\d{2}-\d{2})", stem)
    return found.group(1) if found else ""


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, LLAMA31_8B["vocab_size"], (n,),
                         generator=torch.Generator().manual_seed(seed)).tolist()  # fmt: skip


def foundation(model) -> dict:
    """bench/foundation.py's rows: prefill at 8K and 32K and decode at 8K without a budget
    (decode also as its fraction of the HBM roofline at this GPU's device-copy rate), and
    prefill at 32K under a 24 GiB budget."""
    from common import measure_hbm_bandwidth
    from foundation import decode_roofline_tok_s, ours_prefill

    def prefill_tok_s(engine, length: int) -> float:  # the median of three, as foundation's
        return length / ours_prefill(engine, length, torch.Generator().manual_seed(length))

    engine = make_engine(model)
    figures = {f"prefill {n // K}K tok/s": prefill_tok_s(engine, n) for n in (8 * K, 32 * K)}
    params = [SamplingParams(max_new_tokens=129, ignore_eos=True)]
    engine.generate_batch([_ids(8 * K, 3)], params)
    out = engine.generate_batch([_ids(8 * K, 4)], params)[0]
    figures["decode 8K tok/s"] = out.stats.decode_tok_s
    roofline_tok_s = decode_roofline_tok_s(model, 8 * K, measure_hbm_bandwidth())
    figures["decode 8K of HBM roofline"] = out.stats.decode_tok_s / roofline_tok_s
    del engine
    torch.cuda.empty_cache()
    budgeted = make_engine(model, gpu_memory="24GiB")
    figures["prefill 32K 24GiB tok/s"] = prefill_tok_s(budgeted, 32 * K)
    return figures


def batch_offload(model) -> dict:
    """Eight requests of 32K-64K under a 23 GiB budget, the GPU capped at 24 GiB
    (bench/batch_offload.py, without its single-request check)."""
    from batch_offload import CAP_GIB, headspace_batch
    from common import pinned_h2d_bandwidth
    from offload_runs import gpu_cap

    with gpu_cap(CAP_GIB):
        row = headspace_batch(model, pinned_h2d_bandwidth(), check_single=False)
    return {"batched offload tok/s": row["aggregate_decode_tok_s"],
            "batched offload x PCIe floor": row["ratio_vs_batch_pcie_floor"]}  # fmt: skip


def paged(model) -> dict:
    """The mixed batch of bench/paged.py: 16 prompts of 500..8000 tokens, 64 new each."""
    engine = make_engine(model)
    prompts = [_ids(n, n) for n in range(500, 8001, 500)]
    params = [SamplingParams(max_new_tokens=64, ignore_eos=True)] * len(prompts)
    engine.generate_batch([_ids(n, n + 1) for n in range(500, 8001, 500)], params)
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate_batch(prompts, params)
    return {"mixed batch tok/s": 64 * len(prompts) / (time.perf_counter() - start)}


def offload(model) -> dict:
    """Decode at 32K and 128K with the GPU capped at 24 GiB and a 17 GiB budget
    (bench/offload.py)."""
    from offload_runs import gpu_cap, headspace_run

    figures = {}
    with gpu_cap(24):
        for length in (32 * K, 128 * K):
            row = headspace_run(model, length, "head", "17GiB", 16)
            figures[f"offload decode {length // K}K ms"] = row.get("decode_ms", float("nan"))
    return figures


def hybrid(model) -> dict:
    """Hybrid decode step at 128K, PCIe and CPU split, 23 GiB budget (bench/hybrid.py): the
    median of the last 16 of 72 steps (the CPU's part follows the host's load; the share's
    search starts after 16 steps and settles within about 30 more), and the share it
    settled at."""
    from common import pinned_h2d_bandwidth
    from hybrid import CAP_GIB, K, long_decode
    from offload_runs import gpu_cap

    with gpu_cap(CAP_GIB):
        row = long_decode(model, "hybrid_split", 128 * K - 64, pinned_h2d_bandwidth(), steps=72,
                          timed=16)  # fmt: skip
    print(f"hybrid: each step's share {row['cpu_shares']}", flush=True)
    return {"hybrid decode 128K ms": row["decode_ms"], "hybrid share searched": row["cpu_share"]}


def weight_stream(model) -> dict:
    """Layers streamed under a 12 GiB budget at 32K (bench/weight_stream.py); last: the
    model's layers move to host memory."""
    from weight_stream import BUDGET, measure

    engine = make_engine(model, prefix_caching=False, gpu_memory=BUDGET)
    row = measure(engine, 32 * K, 16, 1024)
    return {"streamed prefill 32K tok/s": row["prefill_tok_s"],
            "streamed decode 32K ms": row["decode_ms"]}  # fmt: skip


def sparsity(model) -> dict:
    """Decode at 128K under KV budgets (bench/sparsity.py): Ada-SnapKV at 0.25 all
    resident, and SnapKV at 0.25 with heads offloaded under a 24 GiB budget (the entries'
    kept tokens staged from host pages); prefill at 128K with half the heads
    ``streaming(4,1024)`` (the patterned prefill's block masks and FlexAttention)."""
    from sparsity import MODES, engine_run, random_profile

    figures = {}
    for mode in ("ada_snapkv 0.25", "snapkv 0.25 head-offload"):
        row = engine_run(model, 128 * K, 64, MODES[mode], "short")
        figures[f"{mode} decode 128K ms"] = row["decode_ms"]
    options = {**MODES["streaming 0.5"], "profile": random_profile()}
    row = engine_run(model, 128 * K, 64, options, "full")
    figures["streaming 0.5 prefill 128K s"] = row["prefill_s"]
    return figures


def reference(kind: str, data: dict, name: str) -> float | None:
    """The committed value of figure ``name`` in ``data``; None where the file does not
    hold it (older files keep other keys)."""
    try:
        return _reference(kind, data, name)
    except (KeyError, IndexError, TypeError):
        return None


def _reference(kind: str, data: dict, name: str) -> float:
    if kind == "sparsity":
        mode, phase = name.split(" prefill")[0].split(" decode")[0], name.split()[-3]
        return data["runs"][str(128 * K)][mode]["prefill_s" if phase == "prefill" else "decode_ms"]
    if kind == "foundation":
        if "configs" in data:
            if "roofline" in name:
                return data["decode_fraction_of_hbm_roofline"]["no budget"]
            rows = data["configs"]["24 GiB budget" if "GiB" in name else "no budget"]
            part, length = ("prefill", name.split()[1]) if "prefill" in name else ("decode", "8K")
            return rows[part][str(int(length[:-1]) * K)]["tok_s"]
        if "roofline" in name:  # (the first files hold no such fraction)
            raise KeyError(name)
        key = "prefill_tok_s" if "prefill" in name else "decode_tok_s"
        return data[key][str(int(name.split()[1][:-1]) * K)]
    if kind == "paged":
        return data["batch_tok_s"]
    if kind == "hybrid":  # (the share searched: no committed figure to hold)
        return None if "share" in name else data["128K"]["hybrid_split"]["decode_ms"]
    if kind == "batch_offload":
        return data["ratio_vs_batch_pcie_floor" if "floor" in name else "aggregate_decode_tok_s"]
    if kind == "weight_stream":
        return data["rows"]["streamed"]["prefill_tok_s" if "prefill" in name else "decode_ms"]
    return data["decode_ms"][str(int(name.split()[2][:-1]) * K)]  # "offload decode 32K ms"


KINDS = {
    "foundation": foundation,
    "paged": paged,
    "offload": offload,
    "hybrid": hybrid,
    "sparsity": sparsity,
    "batch_offload": batch_offload,
    "weight_stream": weight_stream,
}  # fmt: skip (weight_stream last: it moves layers)


def judge(figure: str, value: float, ref: float | None, name: str | None, gpu: str) -> dict:
    """A figure's row: its change against the committed ``ref`` (from file ``name``),
    positive when better (times, seconds and ratios to a floor are better lower), flagged
    ``DROP`` past :data:`DROP` when measured on the committed file's GPU kind."""
    lower_is_better = figure.endswith(("ms", " s", "floor"))
    change = None if ref is None else (value / ref - 1) * (-1 if lower_is_better else 1)
    same_gpu = name is not None and f"_{gpu}_" in name
    flag = "DROP" if same_gpu and change is not None and change < -DROP else ""
    return {"figure": figure, "measured": value, "committed": ref, "file": name,
            "change": change, "flag": flag}  # fmt: skip


def _shown(value: float) -> str:
    """A figure with one decimal, two for a ratio or fraction below 10."""
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", choices=tuple(KINDS), default=list(KINDS),
                        help="which results to re-measure (default: all)")  # fmt: skip
    args = parser.parse_args()
    env = environment()
    gpu = gpu_tag(env)
    model = random_model(LLAMA31_8B)
    rows = []
    for kind in [k for k in KINDS if k in args.kinds]:
        started = time.perf_counter()
        for figure, value in KINDS[kind](model).items():
            rows.append(judge(figure, value, *committed(kind, gpu, figure), gpu))
            print(f"{kind}: {figure} {_shown(value)} ({rows[-1]['flag'] or 'ok'})", flush=True)
        print(f"{kind}: measured in {time.perf_counter() - started:.0f} s", flush=True)
        torch.cuda.empty_cache()
    write_result(f"regress_{gpu}_{env['date']}.json", {"env": env, "rows": rows})
    print(f"\n{'figure':<40}{'measured':>10}{'committed':>11}{'change':>8}  file")
    for r in rows:
        ref = _shown(r["committed"]) if r["committed"] is not None else "-"
        change = f"{100 * r['change']:+.0f}%" if r["change"] is not None else "-"
        print(f"{r['figure']:<40}{_shown(r['measured']):>10}{ref:>11}{change:>8}  {r['file']} "
              f"{r['flag']}")  # fmt: skip


if __name__ == "__main__":
    main()

"""A million exact tokens on one GPU capped at 24 GiB (HeadInfer's headline): Llama-3-8B
with a 1M-token context (Llama-3.1-8B's weight shapes, random bf16 weights), run on one GPU
of a two-GPU machine, whose 256 GiB host holds the 128 GiB of KV in page-locked memory.

    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=src python bench/million.py [--length N] [--steps N]
    PYTHONPATH=src python bench/million.py --approximate [--length N] [--retrieval-heads S]

The engine is built as a user builds it: the model's own context, ``gpu_memory="24GiB"``,
every other option default (``offload="auto"`` picks the tier; recorded as ``auto_picks``).
The process's CUDA allocations are capped at 24 GiB too, so the peak cannot borrow from the
rest of the card. One warm-up compiles the shapes (the prompt's last chunk over an
uncomputed history, two decode steps), then the measured request: the whole prompt's
prefill and ``--steps`` decode steps. Measured in the same run: the pinned host-to-device
bandwidth (the PCIe floor: the offloaded heads' K and V over it per token), the GEMM and
attention rates (the prefill roofline), and the decode step of the other exact tier
(``offload="head"``: every offloaded head streamed) over pages allocated without a prefill
(an exact decode step's work does not depend on the values in its pages; a second 1M
prefill would take as long as the first). ``decode_ms`` per tier is the median step over
such pages for both tiers (a step timed alone; the request's own figure, from its token
times, is in ``runs``). Writes ``million_llama3-8b_<gpu>_<date>.json``
(to $OUT when set), rewritten after each part so that a run cut short keeps what it has.

``--approximate``: the longest context that runs approximately on the same budget (default
2M tokens): a profile's retrieval heads (a share ``--retrieval-heads`` of the entries, the
same number in every layer, as DuoAttention's profiles keep them; random weights have none
to find) keep every token, the others ``streaming(4,1024)`` (the default pattern), every
other option default. Streaming heads hold their sink and a prefill ring while the prompt
streams in, their sink and window after it; retrieval heads past the GPU's room live in host
pages. The prefill roofline counts the attention the patterns compute. Writes
``million_approximate_llama3-8b_<gpu>_<date>.json`` (``kv_fraction_held``: the request's KV
against full attention's; ``modes``: the options).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    LLAMA3_8B,
    environment,
    gpu_tag,
    make_engine,
    pinned_h2d_bandwidth,
    random_model,
    write_result,
)
from headspace.engine.sampling import SamplingParams  # noqa: E402
from headspace.planner.sparsity import attention_share  # noqa: E402
from hybrid import auto_choice, long_decode  # noqa: E402
from offload_runs import compute_rates, gpu_cap, prefill_roofline_tok_s, warm_up  # noqa: E402

GiB = 2**30
MILLION = 2**20
CAP_GIB, BUDGET = 24, "24GiB"
LLAMA3_8B_1M = {  # Llama-3-8B's shapes with a 1M-token context (rope base raised, as the
    **LLAMA3_8B,  # 1048K-context fine-tunes of Llama-3-8B do)
    "max_position_embeddings": MILLION,
    "rope_theta": 3580165449.0,
}
LLAMA3_8B_2M = {**LLAMA3_8B_1M, "max_position_embeddings": 2 * MILLION}


def _request(model, length: int, steps: int, **options) -> tuple:
    """``(engine, warm-up seconds, stats)``: the engine under the budget with ``options``,
    warmed up, then one request's prefill of ``length`` random tokens and ``steps`` decode
    steps."""
    engine = make_engine(model, gpu_memory=BUDGET, progress=True, **options)
    vocab = LLAMA3_8B["vocab_size"]
    start = time.perf_counter()
    warm_up(engine, length, length + steps + 1, engine.lanes.chunk, vocab)
    warm_s = time.perf_counter() - start
    print(f"warm-up {warm_s:.1f} s (chunk {engine.lanes.chunk})", flush=True)
    ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)
    return engine, warm_s, engine.generate_batch([ids.tolist()], [params])[0].stats


def _pcie_floor_s(model, entries: int, length: int, h2d: float) -> float:
    """Seconds a decode step takes to copy ``entries`` entries' K and V of ``length`` tokens
    (bf16) at ``h2d`` bytes/s: the floor of streaming them every step."""
    return entries * 2 * length * model.config.head_dim * 2 / h2d


def exact_run(model, length: int, steps: int, h2d: float) -> dict:
    """The default engine under the budget: warm-up, then one request's prefill of
    ``length`` random tokens and ``steps`` decode steps."""
    engine, warm_s, stats = _request(model, length, steps)
    lane = engine.load().lane(stats.lane)
    offloaded = stats.num_streamed_heads + stats.num_hybrid_heads
    floor_s = _pcie_floor_s(model, offloaded, length, h2d)
    decode_s = stats.decode_seconds / steps
    row = {
        "prefill_s": stats.prefill_seconds, "prefill_tok_s": stats.prefill_tok_s,
        "warm_up_s": warm_s, "prefill_chunk": engine.lanes.chunk,
        "decode_ms": 1000 * decode_s, "pcie_floor_ms": 1000 * floor_s,
        "decode_ratio_vs_pcie_floor": decode_s / floor_s, "decode_steps": steps,
        "auto_picks": auto_choice(engine.lanes, [length]), "head_map": lane.layout,
        "cpu_share": lane.cpu_share, "host_pages_gib": lane.host_bytes / GiB,
        "summary": stats.summary(),
    }  # fmt: skip
    del engine
    return row


def balanced_profile(share: float) -> str:
    """A profile whose retrieval heads, the ``share`` of entries with the highest scores,
    are the same number in every layer (random heads of each), in a temporary file."""
    import tempfile

    from headspace.planner.profile import Profile

    layers, heads = LLAMA3_8B["num_hidden_layers"], LLAMA3_8B["num_key_value_heads"]
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(layers, heads, generator=generator) * 0.1
    for layer in range(layers):
        chosen = torch.randperm(heads, generator=generator)[: round(share * heads)]
        scores[layer, chosen] += 0.9
    path = Path(tempfile.gettempdir()) / f"headspace_bench_balanced_{share}.json"
    Profile("balanced", layers, heads, scores.tolist()).save(path)
    return str(path)


def approximate_run(model, length: int, steps: int, h2d: float, share: float) -> dict:
    """The engine under the budget with retrieval heads (``share``) and streaming heads:
    warm-up, then one request's prefill of ``length`` random tokens and ``steps`` decode
    steps; the PCIe floor is the offloaded entries' K and V, every token, per step."""
    options = {"profile": balanced_profile(share), "retrieval_heads": share}
    engine, warm_s, stats = _request(model, length, steps, **options)
    lane = engine.load().lane(stats.lane)
    plan = lane.plan
    offloaded = plan.head_map.num_offloaded
    floor_s = _pcie_floor_s(model, offloaded, length, h2d)
    decode_s = stats.decode_seconds / steps
    computed = sum(attention_share(e.pattern, length) for e in plan.head_map.entries)
    per_layer = round(share * model.config.num_kv_heads)
    modes = {**options, "sparse_pattern": "streaming(4,1024)",
             "profile": f"{per_layer} retrieval heads a layer"}  # fmt: skip
    row = {
        "prefill_s": stats.prefill_seconds, "prefill_tok_s": stats.prefill_tok_s,
        "warm_up_s": warm_s, "prefill_chunk": engine.lanes.chunk,
        "decode_ms": 1000 * decode_s, "pcie_floor_ms": 1000 * floor_s,
        "decode_ratio_vs_pcie_floor": decode_s / floor_s, "decode_steps": steps,
        "kv_fraction_held": stats.kv_held_fraction, "offloaded_entries": offloaded,
        "attention_share": computed / len(plan.head_map.entries),
        "head_map": plan.head_map.summary(),
        "host_pages_gib": lane.host_bytes / GiB,
        "summary": stats.summary(), "modes": modes,
    }  # fmt: skip
    del engine
    return row


def approximate(args, env: dict, h2d: float, rates: dict) -> None:
    """The approximate row: its result file, printed."""
    result = {"env": env, "config": LLAMA3_8B_2M, "context_tokens": args.length + args.steps,
              "prompt_tokens": args.length, "exact": False, "gpu_memory_budget_gib": CAP_GIB,
              "gpu_cap_gib": CAP_GIB, "h2d_bytes_per_s": h2d, "compute_rates": rates}  # fmt: skip
    name = f"million_approximate_llama3-8b_{gpu_tag(env)}_{env['date']}.json"
    model = random_model(LLAMA3_8B_2M)
    with gpu_cap(CAP_GIB):
        torch.cuda.reset_peak_memory_stats()
        row = approximate_run(model, args.length, args.steps, h2d, args.retrieval_heads)
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
    roofline = prefill_roofline_tok_s(args.length, rates, row["attention_share"])
    keys = ("kv_fraction_held", "modes", "prefill_s", "decode_ms", "decode_ratio_vs_pcie_floor")
    result.update({k: row[k] for k in keys})
    result.update({"prefill_roofline_tok_s": roofline,
                   "prefill_overhead_vs_roofline": roofline / row["prefill_tok_s"] - 1,
                   "run": row})  # fmt: skip
    write_result(name, result)
    print(f"\n{result['context_tokens']:,} tokens approximate ({row['modes']['profile']}, "
          f"KV held {row['kv_fraction_held']:.1%}), GPU budget {BUDGET}: prefill "
          f"{row['prefill_s']:.0f} s ({result['prefill_overhead_vs_roofline']:+.0%} over the "
          f"roofline), decode {row['decode_ms']:.0f} ms/token "
          f"({row['decode_ratio_vs_pcie_floor']:.2f}x the PCIe floor), peak reserved "
          f"{result['peak_reserved_gib']:.2f} GiB")  # fmt: skip


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--length",
        type=int,
        default=None,
        help="prompt tokens (default: 1M - 64; approximate: 2M - 64)",
    )
    parser.add_argument("--steps", type=int, default=8, help="decode steps measured")
    parser.add_argument("--approximate", action="store_true", help="the approximate row only")
    parser.add_argument(
        "--retrieval-heads",
        type=float,
        default=0.25,
        help="approximate: share of entries that keep every token",
    )
    args = parser.parse_args()
    env = environment()
    h2d = pinned_h2d_bandwidth()
    rates = compute_rates()
    if args.approximate:
        args.length = args.length or 2 * MILLION - 64
        approximate(args, env, h2d, rates)
        return
    args.length = args.length or MILLION - 64
    roofline = prefill_roofline_tok_s(args.length, rates)
    result = {"env": env, "config": LLAMA3_8B_1M, "context_tokens": args.length + args.steps,
              "prompt_tokens": args.length, "exact": True, "gpu_memory_budget_gib": CAP_GIB,
              "gpu_cap_gib": CAP_GIB, "h2d_bytes_per_s": h2d, "compute_rates": rates,
              "prefill_roofline_tok_s": roofline}  # fmt: skip
    name = f"million_llama3-8b_{gpu_tag(env)}_{env['date']}.json"
    print({k: v for k, v in result.items() if k != "config"}, flush=True)
    model = random_model(LLAMA3_8B_1M)
    with gpu_cap(CAP_GIB):
        torch.cuda.reset_peak_memory_stats()
        row = exact_run(model, args.length, args.steps, h2d)
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
        mode = row["auto_picks"]
        result.update({"prefill_s": row["prefill_s"],
                       "prefill_overhead_vs_roofline": roofline / row["prefill_tok_s"] - 1,
                       "decode_ms": {}, "decode_ratio_vs_pcie_floor": {}, "runs": {mode: row},
                       "steps_over_allocated_pages": {}})  # fmt: skip
        write_result(name, result)
        print(mode, row, flush=True)
        _release()
        for tier, bench_mode in (("head", "stream"), ("hybrid", "hybrid_split")):
            long = long_decode(model, bench_mode, args.length, h2d, steps=args.steps, budget=BUDGET)
            result["peak_reserved_gib"] = max(
                result["peak_reserved_gib"], torch.cuda.max_memory_reserved() / GiB
            )
            result["decode_ms"][tier] = long["decode_ms"]
            result["decode_ratio_vs_pcie_floor"][tier] = 1 / long["speedup_vs_pcie_floor"]
            result["steps_over_allocated_pages"][tier] = long
            print(tier, long, flush=True)
            _release()
        write_result(name, result)
    _print(result)


def _print(result: dict) -> None:
    print(f"\n{result['context_tokens']:,} tokens exact, GPU budget {BUDGET}: prefill "
          f"{result['prefill_s']:.0f} s ({result['prefill_overhead_vs_roofline']:+.0%} over the "
          f"roofline), peak reserved {result['peak_reserved_gib']:.2f} GiB")  # fmt: skip
    print(f"{'tier':>8} {'ms/token':>9} {'x PCIe floor':>13}")
    for mode, ms in result["decode_ms"].items():
        print(f"{mode:>8} {ms:>9.1f} {result['decode_ratio_vs_pcie_floor'][mode]:>13.2f}")


if __name__ == "__main__":
    main()

"""Prefill attention under per-head patterns, attention alone (one layer of Llama-3-8B's
shape: 32 query heads over 8 kv heads, head dim 128, bf16): the last chunk of a long
prompt, all heads full against half the heads sparse, on this GPU.

    PYTHONPATH=src python bench/profiles/patterns.py [--contexts 32768 131072] [--chunk 8192]

For each context and mix: milliseconds of the patterned attention (estimation, block mask,
the full kv heads through cuDNN SDPA and the sparse ones through compiled FlexAttention),
beside cuDNN SDPA for every head (the dense path the engine takes for a chunk today) and
FlexAttention with every head full. Half the heads sparse: the first four kv heads' query
heads keep ``full``, the other four's take the pattern. Also the largest difference
between FlexAttention with every head full and SDPA (both exact).

With ``--whole-prefill CONTEXT``, the attention of every chunk of one layer's prefill of
CONTEXT tokens, through the engine's call (keys padded to a power-of-two capacity), all full
and half sparse: times 32 layers, the attention part of an end-to-end prefill (the rest is
GEMMs, norms, RoPE and copies). ``--breakdown CONTEXT`` adds, for the last chunk of that
context, each mix's CUDA kernels by total time, the host's time to issue it and its host
ops (torch.profiler). Writes ``patterns_attention_<gpu>_<date>.json``
(to $OUT when set).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from common import cuda_time, environment, gpu_tag, write_result  # noqa: E402
from headspace.attention import attend  # noqa: E402
from headspace.attention.patterns import estimate
from headspace.attention.sparse_prefill import (  # noqa: E402
    block_maps,
    flex_pattern_attention,
    prefill_with_patterns,
    sparse_prefill_attention,
)
from headspace.kv.spec import Pattern, padded_length

HEADS, KV_HEADS, DIM = 32, 8, 128
SPARSE = ("streaming(4,4096)", "vertical_slash(1000,6096)", "block_sparse(64)")


def _inputs(context: int, chunk: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(HEADS, chunk, DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(KV_HEADS, context, DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(KV_HEADS, context, DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    return q, k, v


def _run(q, k, v, patterns: list[Pattern]):
    return sparse_prefill_attention(q, k, v, estimate(patterns, q, k))


def measure(context: int, chunk: int) -> dict:
    q, k, v = _inputs(context, chunk)
    full = [Pattern()] * HEADS
    table_full = estimate(full, q, k)

    def flex_full():
        return flex_pattern_attention(q, k, v, table_full)

    row = {"sdpa_ms": 1000 * cuda_time(lambda: attend(q, k, v, causal=True), repeat=5),
           "flex_full_ms": 1000 * cuda_time(flex_full, repeat=5)}  # fmt: skip
    exact = attend(q, k, v, causal=True)[0].float()
    difference = (flex_full()[0].float() - exact).abs().max().item()
    row["flex_full_max_abs_diff_vs_sdpa"] = difference
    for text in SPARSE:
        pattern = Pattern.parse(text)
        half = [Pattern()] * (HEADS // 2) + [pattern] * (HEADS // 2)
        table = estimate(half, q, k)
        touched, _ = block_maps(table)
        causal_blocks = block_maps(estimate(full, q, k))[0].sum().item()
        ms = 1000 * cuda_time(lambda half=half: _run(q, k, v, half), repeat=5)
        estimate_ms = 1000 * cuda_time(lambda half=half: estimate(half, q, k), repeat=5)
        row[text] = {"half_sparse_ms": ms, "estimate_ms": estimate_ms,
                     "blocks_vs_full": touched.sum().item() / causal_blocks,
                     "speedup_vs_sdpa": row["sdpa_ms"] / ms,
                     "speedup_vs_flex_full": row["flex_full_ms"] / ms}  # fmt: skip
    return row


def _mixes() -> dict[str, list[Pattern]]:
    """Every head full, and half the heads (the last four kv heads') under each pattern."""
    full = [Pattern()] * HEADS
    return {"full": full} | {t: full[: HEADS // 2] + [Pattern.parse(t)] * (HEADS // 2)
                             for t in SPARSE}  # fmt: skip


def whole_prefill(context: int, chunk: int) -> dict:
    """Milliseconds of one layer's attention over every chunk of a ``context``-token prefill
    per mix, the way the engine calls it (keys padded to a power-of-two capacity)."""
    q, k, v = _inputs(context, chunk)
    totals = dict.fromkeys(_mixes(), 0.0)
    for end in range(chunk, context + 1, chunk):
        capacity = padded_length(end)
        k_pad = torch.nn.functional.pad(k[:, :end], (0, 0, 0, capacity - end))
        v_pad = torch.nn.functional.pad(v[:, :end], (0, 0, 0, capacity - end))
        for name, mix in _mixes().items():
            if name == "full":  # the engine's dense path: the fused causal kernel
                call = functools.partial(attend, q, k[:, :end], v[:, :end], causal=True)
            else:
                call = functools.partial(prefill_with_patterns, q, k_pad, v_pad, end, mix)
            totals[name] += 1000 * cuda_time(call, repeat=3)
    return {
        name: {"layer_ms": ms, "model_s": ms * 32 / 1000, "speedup_vs_full": totals["full"] / ms}
        for name, ms in totals.items()
    }


def breakdown(context: int, chunk: int, top: int = 8) -> dict:
    """Each mix on the last chunk: its CUDA kernels by total time, the host's time to issue
    the call (no sync inside it) and the host ops by self time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v = _inputs(context, chunk)
    result = {}
    for name, mix in _mixes().items():
        _run(q, k, v, mix)  # compiled and warm
        torch.cuda.synchronize()
        start = time.perf_counter()
        _run(q, k, v, mix)
        host_ms = 1000 * (time.perf_counter() - start)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _run(q, k, v, mix)
            torch.cuda.synchronize()
        events = prof.key_averages()
        kernels = sorted(events, key=lambda e: -e.device_time_total)[:top]
        host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
        result[name] = {
            "host_ms": host_ms,
            "kernels": [[e.key[:80], e.device_time_total / 1000] for e in kernels],
            "host_ops": [[e.key[:80], e.self_cpu_time_total / 1000] for e in host],
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--whole-prefill", type=int, default=0, metavar="CONTEXT")
    parser.add_argument("--breakdown", type=int, default=0, metavar="CONTEXT")
    args = parser.parse_args()
    env = environment()
    result = {"env": env, "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM},
              "chunk": args.chunk, "contexts": {}}  # fmt: skip
    for context in args.contexts:
        try:
            result["contexts"][str(context)] = measure(context, args.chunk)
        except Exception as exc:  # keep the whole message for the record
            out = Path(os.environ.get("OUT", "."))
            (out / f"patterns_error_{context}.txt").write_text(f"{type(exc).__name__}: {exc}")
            raise
        print(context, result["contexts"][str(context)], flush=True)
        torch.cuda.empty_cache()
    if args.breakdown:
        result["breakdown"] = breakdown(args.breakdown, args.chunk)
    if args.whole_prefill:
        result["whole_prefill"] = {
            "context": args.whole_prefill,
            "mixes": whole_prefill(args.whole_prefill, args.chunk),
        }
    gpu = gpu_tag(env)
    write_result(f"patterns_attention_{gpu}_{env['date']}.json", result)
    print(f"\n{'context':>8} {'mix (half the heads)':<28} {'ms':>8} {'SDPA ms':>8} "
          f"{'flex full':>9} {'x SDPA':>7} {'blocks':>7}")  # fmt: skip
    for context, row in result["contexts"].items():
        for text in SPARSE:
            cell = row[text]
            print(f"{context:>8} {text:<28} {cell['half_sparse_ms']:>8.2f} {row['sdpa_ms']:>8.2f} "
                  f"{row['flex_full_ms']:>9.2f} {cell['speedup_vs_sdpa']:>7.2f} "
                  f"{cell['blocks_vs_full']:>7.2f}")  # fmt: skip
    for name, cell in result.get("breakdown", {}).items():
        print(
            f"\n{name}: host {cell['host_ms']:.2f} ms to issue; kernels: "
            + "; ".join(f"{kernel[:40]} {ms:.2f}" for kernel, ms in cell["kernels"][:5])
            + "\n  host ops: "
            + "; ".join(f"{op[:40]} {ms:.2f}" for op, ms in cell["host_ops"][:6])
        )
    if args.whole_prefill:
        print(f"\nwhole prefill of {args.whole_prefill} tokens, attention of one layer:")
        for name, cell in result["whole_prefill"]["mixes"].items():
            print(f"  {name:<28} {cell['layer_ms']:>9.1f} ms  (x32 layers {cell['model_s']:.2f} s)"
                  f"  {cell['speedup_vs_full']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()

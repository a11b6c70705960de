"""Long prompts under a small budget, the way `headspace generate` runs them: a 128K prompt
under 24 GiB and a 512K one under 17 GiB, each in a fresh process after a first one (whose
compile caches it then reads), against the prefill's compute roofline and the decode's PCIe
floor, both from rates measured in the same run.

    PYTHONPATH=src python bench/long_prompt.py [--lengths 128 512] [--steps 8]

A saved Llama-3.1-8B-shaped checkpoint (random bf16 weights, `bench/serve.py`'s) is loaded
as `generate` loads it: `LLM(model, device="cuda", gpu_memory=...)` with default options
(the CLI's placement; past the trained 128K context, `max_context` as `--max-context` sets
it), warmed up in the prompt's shapes (`Engine.warm_up`, as `generate` runs it), then one
request of random token ids. The roofline counts the GEMMs and the causal attention at the
GEMM and cuDNN attention rates measured here (`bench/million.py`'s); the floor is the
offloaded entries' K/V of one step over PCIe at the copy rate measured here. Writes
``long_prompt_llama3-8b_<gpu>_<date>.json`` (to $OUT when set); its ``runs`` hold the
second process's figures, with the first's prefill beside them; each process's seconds of
compiling, in its warm-up and in the request, are recorded apart (the compile meter).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import LLAMA31_8B, environment, gpu_tag, pinned_h2d_bandwidth, write_result  # noqa: E402

K, GiB = 1024, 2**30
BUDGETS = {128: "24GiB", 512: "17GiB"}  # prompt length (K tokens): the GPU budget
TRAINED_CONTEXT = LLAMA31_8B["max_position_embeddings"]


def floor_ms(offloaded_entries: int, tokens: int, h2d: float) -> float:
    """A decode step's PCIe floor: the offloaded entries' K and V (bf16) of ``tokens`` tokens
    at ``h2d`` bytes/s, in ms (the planner's :func:`offloaded_seconds` over PCIe alone)."""
    from headspace.planner.memory import Hardware, offloaded_seconds

    entries_bytes = offloaded_entries * 2 * tokens * LLAMA31_8B["head_dim"] * 2
    layers = LLAMA31_8B["num_hidden_layers"]
    return 1e3 * offloaded_seconds(entries_bytes, layers, False, None, Hardware(h2d_bytes=h2d))


def worker(model_dir: str, length: int, budget: str, steps: int) -> None:
    """One process's request (printed as JSON on the last line)."""
    from headspace.api import LLM
    from headspace.engine.engine import compile_in_process
    from headspace.engine.sampling import SamplingParams
    from headspace.model.compile_meter import COMPILE_METER

    compile_in_process()  # as generate does; past the trained context, as --max-context does
    longer = {"max_context": length + steps + 1} if length + steps >= TRAINED_CONTEXT else {}
    llm = LLM(model_dir, device="cuda", gpu_memory=budget, **longer)
    vocab = llm.engine.model.config.vocab_size
    ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)
    compiled = COMPILE_METER.seconds
    warm_up_s = llm.engine.warm_up(length, decode=True, offload=True,  # as generate's
                                   alone=length + params.max_new_tokens)  # fmt: skip
    warm_up_compile_s, compiled = COMPILE_METER.seconds - compiled, COMPILE_METER.seconds
    torch.cuda.reset_peak_memory_stats()
    stats = llm.generate(ids, params)[0].stats
    print(json.dumps({
        "warm_up_s": warm_up_s, "warm_up_compile_s": warm_up_compile_s,
        "request_compile_s": COMPILE_METER.seconds - compiled,  # (in prefill_s or decode_ms)
        "prefill_s": stats.prefill_seconds,
        "decode_ms": 1e3 * stats.decode_seconds / max(1, stats.generated_tokens - 1),
        "heads": {"resident": stats.num_gpu_heads, "streamed": stats.num_streamed_heads,
                  "hybrid": stats.num_hybrid_heads},
        "cpu_share": stats.cpu_share, "lane": stats.lane,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB,
        "summary": stats.summary(),
    }))  # fmt: skip


def one_process(model_dir: Path, length: int, budget: str, steps: int) -> dict:
    command = [sys.executable, __file__, "--worker", str(model_dir), str(length), budget,
               str(steps)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(model_dir: Path, kilo: int, steps: int, h2d: float, rates: dict) -> dict:
    """The second process's run of a ``kilo``K prompt, with the first's prefill beside it."""
    from offload_runs import prefill_roofline_tok_s

    length, budget = kilo * K - 1024, BUDGETS[kilo]
    first = one_process(model_dir, length, budget, steps)
    run = one_process(model_dir, length, budget, steps)
    if "error" in run or "error" in first:
        return {"error": run.get("error") or first.get("error")}
    roofline_s = length / prefill_roofline_tok_s(length, rates)
    offloaded = run["heads"]["streamed"] + run["heads"]["hybrid"]
    floor = floor_ms(offloaded, length, h2d)
    return {**run, "prompt_tokens": length, "budget_gib": float(budget[:-3]),
            "prefill_roofline_s": roofline_s, "prefill_vs_roofline": run["prefill_s"] / roofline_s,
            "first_process_prefill_s": first["prefill_s"],
            "first_process_compile_s": {k: first[k] for k in ("warm_up_compile_s",
                                                              "request_compile_s")},
            "decode_pcie_floor_ms": floor,
            "decode_speedup_vs_floor": floor / run["decode_ms"] if offloaded else None}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="+", type=int, choices=tuple(BUDGETS),
                        default=list(BUDGETS), help="prompt lengths, K tokens")  # fmt: skip
    parser.add_argument("--steps", type=int, default=8, help="decode steps measured")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        model_dir, length, budget, steps = args.worker
        worker(model_dir, int(length), budget, int(steps))
        return
    from offload_runs import compute_rates
    from serve import save_checkpoint

    env = environment()
    h2d, rates = pinned_h2d_bandwidth(), compute_rates()
    result = {"env": env, "config": LLAMA31_8B, "h2d_bytes_per_s": h2d, "compute_rates": rates,
              "runs": {}}  # fmt: skip
    name = f"long_prompt_llama3-8b_{gpu_tag(env)}_{env['date']}.json"
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        model_dir = Path(tmp) / "llama3-8b-random"
        save_checkpoint(model_dir)
        for kilo in args.lengths:
            result["runs"][f"{kilo}K"] = measure(model_dir, kilo, args.steps, h2d, rates)
            path = write_result(name, result)
            print(kilo, {k: v for k, v in result["runs"][f"{kilo}K"].items() if k != "summary"},
                  flush=True)  # fmt: skip
    print(f"\nwrote {path}")
    for label, run in result["runs"].items():
        if "error" in run:
            print(f"{label}: error")
            continue
        print(f"{label}: prefill {run['prefill_s']:.1f} s ({run['prefill_vs_roofline']:.2f}x its "
              f"roofline; first process {run['first_process_prefill_s']:.1f} s), decode "
              f"{run['decode_ms']:.0f} ms/token (floor {run['decode_pcie_floor_ms']:.0f}), "
              f"peak {run['peak_reserved_gib']:.2f} of {run['budget_gib']:.0f} GiB")  # fmt: skip


if __name__ == "__main__":
    main()

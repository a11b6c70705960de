"""How the sparse hybrid mode's kept share moves over a long generation: the embedded model on
the CPU, a 4K prompt of alice29 with a 1K GPU window (the quality runs' set-up), greedy
tokens to ``--new-tokens``; every ``--every`` tokens, the (min, median, max) share of the
CPU-side tokens kept per hybrid (layer, kv head) and the CPU side's length.

    PYTHONPATH=src python bench/profiles/sparse_growth.py [--beta 1] [--new-tokens 2048]
        [--every 256]

Each page that leaves the window is re-evaluated and a dropped token can be reinstated, so
the share could drift up (more tokens pass the threshold as queries vary) or down (the
threshold ``beta / n`` falls as the history grows). Writes
``sparse_growth_<model>_cpu.json`` (to $OUT when set).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from common import ran_lane, write_result  # noqa: E402
from headspace.api import LLM  # noqa: E402
from headspace.engine.sampling import SamplingParams  # noqa: E402
from headspace.eval.data import builtin_text  # noqa: E402

PROMPT, WINDOW = 4096, 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--beta", type=float, default=1.0)
    parser.add_argument("--new-tokens", type=int, default=2048)
    parser.add_argument("--every", type=int, default=256)
    args = parser.parse_args()
    llm = LLM(gpu_memory="600MB", offload="hybrid", cpu_sparsity=args.beta, gpu_window=WINDOW)
    engine = llm.engine
    prompt = engine.encode(builtin_text("alice29"), False)[:PROMPT]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    request = engine.add_request(prompt, params)
    rows, started = [], time.perf_counter()

    def record(generated: int, kept: tuple[float, float, float]) -> None:
        rows.append({"generated": generated, "cpu_side_tokens": PROMPT + generated - WINDOW,
                     "kept_min": kept[0], "kept_median": kept[1], "kept_max": kept[2]})  # fmt: skip
        print(f"{generated:>6} tokens  kept {kept[1]:.1%} median "
              f"({kept[0]:.1%}-{kept[2]:.1%})", flush=True)  # fmt: skip

    while engine.has_unfinished():
        for out in engine.step():
            generated = len(out.token_ids)
            if out.finish_reason is not None:  # its final stats hold the last share
                record(generated, out.stats.cpu_kept_fraction)
            elif generated % args.every == 0 and generated > (rows[-1]["generated"] if rows else 0):
                record(generated, ran_lane(engine).runner.kept_summary(request))
    result = {"model": "SmolLM2-135M-Instruct (embedded)", "device": "cpu", "beta": args.beta,
              "prompt_tokens": PROMPT, "gpu_window": WINDOW, "text": "alice29",
              "seconds": time.perf_counter() - started, "kept_over_generation": rows}  # fmt: skip
    write_result("sparse_growth_smollm2-135m_cpu.json", result)


if __name__ == "__main__":
    main()

"""Where a DuoAttention-style prefill spends its GPU time (Llama-3.1-8B architecture, random
bf16 weights): half the heads ``streaming(4,1024)``, half under Ada-SnapKV at 0.25, one
prompt of ``--context`` tokens after an untimed warm-up; prints the top kernels by CUDA time
(torch.profiler) and writes them to ``profile_duo_prefill_<gpu>_<date>.json``.

    PYTHONPATH=src python bench/profile_duo_prefill.py [--context 65536]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import LLAMA31_8B, environment, make_engine, random_model, write_result  # noqa: E402
from headspace.engine.sampling import SamplingParams  # noqa: E402
from multigpu import SCENARIOS, _prompt, make_profile  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=65536)
    args = parser.parse_args()
    profile = Path("/tmp/duo_profile.json")
    make_profile("duo", args.context, profile)
    engine = make_engine(random_model(LLAMA31_8B), profile=str(profile), **SCENARIOS["duo"])
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    engine.generate_batch([_prompt(16384, seed=4)], [params])
    ids = _prompt(args.context, seed=3)
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        (output,) = engine.generate_batch([ids], [params])
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(table)
    rows = [
        {"name": e.key, "cuda_ms": e.device_time_total / 1000, "calls": e.count}
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:40]
    ]
    env = environment()
    write_result(f"profile_duo_prefill_{env['gpu'].split()[-1].lower()}_{env['date']}.json",
                 {"environment": env, "context": args.context, "options": SCENARIOS["duo"],
                  "prefill_seconds": output.stats.prefill_seconds, "kernels": rows})  # fmt: skip


if __name__ == "__main__":
    main()

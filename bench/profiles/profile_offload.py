"""Where the time of a 32K prefill goes under head offload at a 17 GiB budget.

    PYTHONPATH=src python bench/profiles/profile_offload.py

Separates the chunk size from streaming: no offload with the offload run's 4096-token chunk,
then head offload, then the head run's top CUDA kernels and CPU-side ops (torch.profiler).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent.parent))
from common import LLAMA3_8B, cuda_time, make_engine, prefill_once, random_model  # noqa: E402
from offload_runs import gpu_cap  # noqa: E402

LENGTH = 32768


def timed_prefill(model, **options) -> tuple[float, object]:
    engine = make_engine(model, max_context=LENGTH + 64, prefix_caching=False, **options)
    ids = torch.randint(0, LLAMA3_8B["vocab_size"], (LENGTH,)).tolist()
    seconds = cuda_time(lambda: prefill_once(engine, ids), warmup=1, repeat=1)  # warm: compiled
    return seconds, (engine, ids)


def main() -> None:
    model = random_model(LLAMA3_8B)
    rows = []
    runs = [("none, chunk 32768", {"offload": "none"}),
            ("none, chunk 4096", {"offload": "none", "prefill_chunk": 4096}),
            ("head, 17 GiB", {"offload": "head", "gpu_memory": "17GiB"})]  # fmt: skip
    for name, options in runs:
        with gpu_cap(24 if "gpu_memory" in options else None):
            seconds, (engine, ids) = timed_prefill(model, **options)
            rows.append((name, seconds, engine.lanes.chunk))
            if name.startswith("head"):
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    prefill_once(engine, ids)
                    torch.cuda.synchronize()
        del engine
        torch.cuda.empty_cache()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    )
    print(
        prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60)
    )
    print(f"{'32K prefill':<20}{'seconds':>9}{'tok/s':>9}{'chunk':>7}")
    for name, seconds, chunk in rows:
        print(f"{name:<20}{seconds:>9.2f}{LENGTH / seconds:>9.0f}{chunk:>7}")


if __name__ == "__main__":
    main()

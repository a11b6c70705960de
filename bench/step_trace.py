"""A torch profiler trace of a few decode steps of a running benchmark: where a step's time
goes (graph replay or eager launches, kernels, collectives, the host's Python).

``trace_decode_steps(engine, rows, folder, name)`` wraps the engine's decode: once ``skip``
steps of ``rows`` sequences have run, it records the next ``steps`` such steps and writes
``<name>.json`` (a Chrome trace) and ``<name>.txt`` (the ops by CUDA and by CPU time) to
``folder``. Used by ``bench/multigpu.py --trace DIR``.
"""

from __future__ import annotations

from pathlib import Path

from torch.profiler import ProfilerActivity, profile


def trace_decode_steps(engine, rows: int, folder: Path, name: str, skip: int = 10,
                       steps: int = 3) -> None:  # fmt: skip
    """Record ``steps`` decode steps of ``rows`` sequences after ``skip`` of them."""
    seen = [0]
    recorder = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])

    def traced(seq_ids, step):
        if len(seq_ids) != rows:
            return step()
        seen[0] += 1
        if seen[0] == skip + 1:
            recorder.start()
        result = step()
        if seen[0] == skip + steps:
            recorder.stop()
            folder.mkdir(parents=True, exist_ok=True)
            recorder.export_chrome_trace(str(folder / f"{name}.json"))
            averages = recorder.key_averages()
            tables = [averages.table(sort_by=key, row_limit=25)
                      for key in ("cuda_time_total", "cpu_time_total")]  # fmt: skip
            (folder / f"{name}.txt").write_text("\n\n".join(tables))
        return result

    engine.lanes.hooks.decode_hooks.append(traced)

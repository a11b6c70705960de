"""Re-measure the README's headline rows whose hardware is here, one benchmark after another,
and say which were skipped and why (`bench/regress.py` re-judges the one-GPU figures it
covers against their committed files; this runs every row's own benchmark).

    PYTHONPATH=src python bench/headlines.py --dry-run            # what would run, what not
    PYTHONPATH=src python bench/headlines.py --rows mixed arrivals  # some of them

Each benchmark writes its result file as it always does (into $OUT when set); copy the new
files into bench/results/ and update the README rows that name them
(`tests/test_readme_figures.py` then checks each figure against its file). A row runs when
this machine has its GPUs and host memory; its minutes are an H100's, about.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parents[1]


@dataclass(frozen=True)
class Headline:
    """One README row's benchmark: the row's mode (the start of its first column), the
    command (run from the repository root), what it needs and about how long it takes."""

    mode: str
    command: tuple[str, ...]
    minutes: int
    gpus: int = 1  # 0: runs on the CPU
    host_gib: int = 0  # host memory it needs, GiB (a host of 128 GiB reports about 125)


HEADLINES = {
    "foundation": Headline("all resident", ("bench/foundation.py",), 6),
    "decode_compile": Headline("all resident", ("bench/decode_compile.py",), 8),
    "paged": Headline("paged pool", ("bench/paged.py",), 5),
    "arrivals": Headline("requests arriving", ("bench/arrivals.py",), 6),
    "mixed": Headline("OpenAI-compatible server", ("bench/mixed.py", "--scenarios", "a"), 5,
                      host_gib=120),  # fmt: skip
    "serve_burst": Headline("a burst of requests", ("bench/serve_burst.py",), 10),
    "offload": Headline("head offload", ("bench/offload.py", "--part", "speed"), 10,
                        host_gib=100),  # fmt: skip
    "million": Headline("a million tokens", ("bench/million.py",), 25, host_gib=240),
    "two_million": Headline("two million tokens", ("bench/million.py", "--approximate"), 30,
                            host_gib=120),  # fmt: skip
    "hybrid": Headline("hybrid GPU-CPU attention", ("bench/hybrid.py", "--search", "128", "512"),
                       15, host_gib=100),  # fmt: skip
    "hybrid_sparse": Headline("hybrid sparse", ("bench/hybrid_window.py",), 10, host_gib=100),
    "hybrid_sparse_quality": Headline("hybrid sparse", (  # the README row's command (CPU)
        "-m", "headspace.cli", "eval", "ppl", "--text", "alice29,plrabn12", "--context", "4k",
        "--decode-tokens", "512", "--max-tokens", "4608", "--gpu-memory", "600MB",
        "--gpu-window", "1024", "--compare", "none", "hybrid-sparse:1"), 20, gpus=0),
    "batch_offload": Headline("batched offload", ("bench/batch_offload.py",), 6, host_gib=64),
    "weight_stream": Headline("streamed weights", ("bench/weight_stream.py",), 5),
    "sparsity": Headline("per-head KV budgets", ("bench/sparsity.py",), 15, host_gib=100),
    "patterns": Headline("per-head patterns", ("bench/sparsity.py", "--contexts", "524288"), 15,
                         host_gib=100),
    "flex": Headline("FlexAttention over pages", ("bench/flex_paged.py",), 8),
    "multigpu": Headline("several GPUs", ("bench/multigpu.py", "--gpus", "1", "4", "--scenario",
                         "ada_snapkv", "--batch", "4", "--sharpen", "0.25", "4"), 20, gpus=4),
    "copies": Headline("heads balanced with copies", (  # the README row's command
        "bench/multigpu.py", "--gpus", "2", "--model", "qwen2.5-3b", "--scenario", "copies",
        "--batch", "256", "--context", "32768", "--kv-budget", "8192", "--decode", "1300",
        "--sharpen", "0.25", "4", "--balance-phase", "decode", "--warmup-batch", "8",
        "--stand-in", "--solvers", "uniform", "fairkv", "uniform-again", "--copy-cost",
        "bench/results/copy_cost_h200_2026-11-28.json", "--served-rate"), 20, gpus=2),
}  # fmt: skip
# the same copies run synchronised (the README row's second figure: without --served-rate)
HEADLINES["copies_synced"] = Headline(
    "heads balanced with copies", HEADLINES["copies"].command[:-1], 20, gpus=2
)


@dataclass(frozen=True)
class Machine:
    """What a headline needs of this machine: its GPUs and host memory (GiB)."""

    gpus: int
    host_gib: float

    @classmethod
    def here(cls) -> Machine:
        import torch

        from headspace.engine.memory import device_total_bytes

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return cls(gpus, device_total_bytes(torch.device("cpu")) / 2**30)


def skip_reason(headline: Headline, machine: Machine) -> str | None:
    """Why ``headline`` cannot run on ``machine`` (None: it can)."""
    if headline.gpus and not machine.gpus:
        return "needs a CUDA GPU; this machine has none"
    if headline.gpus > machine.gpus:
        return f"needs {headline.gpus} GPUs; this machine has {machine.gpus}"
    if headline.host_gib > machine.host_gib:
        return (f"needs {headline.host_gib} GiB of host memory; this host has "
                f"{machine.host_gib:.0f}")  # fmt: skip
    return None


def plan(names: list[str], machine: Machine) -> list[tuple[str, str | None]]:
    """(name, why it is skipped or None) of each headline asked for, in the table's order."""
    return [(name, skip_reason(HEADLINES[name], machine)) for name in HEADLINES if name in names]


def run(name: str) -> tuple[int, float]:
    """Run one headline's benchmark: (exit status, seconds)."""
    headline, started = HEADLINES[name], time.perf_counter()
    paths = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    done = subprocess.run([sys.executable, *headline.command], cwd=ROOT, env=env)
    return done.returncode, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=tuple(HEADLINES), default=list(HEADLINES))
    parser.add_argument("--dry-run", action="store_true", help="only say what would run")
    args = parser.parse_args(argv)
    rows, results = plan(args.rows, Machine.here()), []
    for name, reason in rows:
        if reason is None and not args.dry_run:
            status, seconds = run(name)
            reason = "ran" if status == 0 else f"failed (exit {status})"
            results.append((name, f"{reason} in {seconds / 60:.1f} min"))
        else:
            minutes = HEADLINES[name].minutes
            results.append((name, reason and f"skipped: {reason}" or f"would run (~{minutes} min)"))
    width = max(len(name) for name, _ in results)
    for name, outcome in results:
        print(f"{name:<{width}}  {HEADLINES[name].mode:<28}  {outcome}")
    return 1 if any("failed" in outcome for _, outcome in results) else 0


if __name__ == "__main__":
    sys.exit(main())

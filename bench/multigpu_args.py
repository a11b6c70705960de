"""The multi-GPU benchmark's command line (``bench/multigpu.py``; its docstring tells the
scenarios and what each run measures)."""

from __future__ import annotations

import argparse

from common import MODELS
from headspace.parallel.config import PHASES


def command_line(description: str, scenarios: tuple[str, ...],
                 solvers: tuple[str, ...]) -> argparse.ArgumentParser:  # fmt: skip
    """The benchmark's arguments (the driver's, and the hidden ones its workers take)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--solvers", nargs="+", default=list(solvers[:4]), choices=solvers)
    parser.add_argument("--scenario", default="duo", choices=scenarios)
    parser.add_argument(
        "--sharpen",
        type=float,
        nargs=2,
        metavar=("LOW", "HIGH"),
        help="scale each kv head's keys by a log-uniform factor in this range",
    )
    parser.add_argument("--batch", type=int, default=1, help="prompts served at once")
    parser.add_argument(
        "--warmup-batch",
        type=int,
        help="prompts in the untimed batch before each solver's (default: --batch); fewer "
        "compile the same prefill shapes, and the full batch's decode graph is then captured "
        "in its first timed step, which the median of the steps leaves out",
    )
    parser.add_argument(
        "--balance-phase",
        default="auto",
        choices=PHASES,
        help="the phase whose costs the solvers balance (the engine's option)",
    )
    parser.add_argument(
        "--work",
        help="a folder that keeps the profile and each GPU count's run of each solver; those "
        "already there are reused (one invocation split over several calls)",
    )
    parser.add_argument("--model", default="llama3-8b", choices=tuple(MODELS))
    parser.add_argument("--layers", type=int, help="the model's first LAYERS layers only")
    parser.add_argument(
        "--copy-cost", help="bench/profiles/copy_cost.py's result, for copy_cost_us"
    )
    parser.add_argument(
        "--copy-seconds",
        type=float,
        help="the engine's copy_seconds: what the solvers charge a copy (0: nothing, so they "
        "make each copy their cost model says levels a layer; default: the cost model's)",
    )
    parser.add_argument(
        "--balance-batch",
        type=int,
        help="the engine's balance_batch: the sequences the solvers price a decode step at "
        "(default: --batch for the copies scenario, else 1; runs before it priced at 1)",
    )
    parser.add_argument(
        "--trace",
        help="a folder for a torch profiler trace of three decode steps of the batch, per "
        "solver and rank (bench/step_trace.py)",
    )
    parser.add_argument(
        "--kv-budget",
        type=int,
        help="the scenario's KV budget in tokens a head in place of its own (copies: 1024), "
        "e.g. 8192 at --context 32768, where the cost model makes copies pay",
    )
    _run_flag(
        parser,
        "--stand-in",
        "decode over pages at the lengths the budget's policy kept of the run's first "
        "prompts (measured on one GPU with the profile), the prompts not computed: the "
        "decode figures of a batch whose prefills would take minutes; prefill not measured",
    )
    _run_flag(
        parser,
        "--served-rate",
        "the decode rate from the pace of the batch's steps as the engine runs them "
        "(not synchronised step by step: the host's work for a step overlaps the GPU's)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--profile", help=argparse.SUPPRESS)
    return parser


def _run_flag(parser: argparse.ArgumentParser, name: str, help: str) -> None:
    """A switch among a run's settings (``multigpu_work.RUN_KEYS``): unset reads None, as
    in a --work folder begun before the switch existed."""
    parser.add_argument(name, action="store_true", default=None, help=help)

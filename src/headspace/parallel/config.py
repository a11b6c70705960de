"""Head-parallel options: one documented dataclass; ``plan`` derives its flags from it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_args

from headspace.errors import UserError
from headspace.parallel.solvers import SOLVERS

Balance = Literal["uniform", "random", "greedy", "ga", "fairkv", "exact", "copy_search"]
Phase = Literal["auto", "prefill", "decode"]
PHASES = get_args(Phase)
assert get_args(Balance) == tuple(SOLVERS)
# the fields the engine takes as options under torchrun (``gpus`` is the world size there,
# and ``seed`` would read as sampling's)
ENGINE_FIELDS = ("balance", "replicas", "balance_phase", "copy_seconds", "balance_batch")


def _option(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class ParallelConfig:
    """How kv heads are spread over ranks (each field is also a command-line flag)."""

    SECTION: ClassVar[str] = "multi-GPU (under torchrun)"
    gpus: int = _option(1, "GPUs the kv heads are spread over (plan prints each one's load)")
    balance: Balance = _option(
        "fairkv", "head-to-GPU solver: uniform (tensor-parallel blocks), random, greedy "
        "(longest first, then moves), ga (genetic search), fairkv (greedy, then fair-copying "
        "within --replicas), exact (branch and bound, small layers), copy_search (FairKV's "
        "Algorithms 1 and 2: every copy scheme within --replicas, each placed by branch and "
        "bound; small layers)",
    )  # fmt: skip
    replicas: int = _option(
        2, "fairkv: extra copies of heavy heads a layer may make; the copies divide the head's "
        "attention (token ranges merged by log-sum-exp)",
    )  # fmt: skip
    balance_phase: Phase = _option(
        "auto", "which step's costs to balance: prefill (a chunk's attention, which patterns "
        "change), decode (the KV each head reads, which budgets change), or auto (both at "
        "once, each phase's slowest ranks weighed by one over the phase's total)",
    )  # fmt: skip
    copy_seconds: float | None = _option(
        None, "seconds each copy of a divided kv head adds to its rank's step in the solvers' "
        "cost model, whatever the batch (default: the planner's measured figures: 20 us, "
        "and at decode 0.27 us a sequence beside the 0.12 us a sequence of kernel rows it "
        "repeats; set, the kernel rows of every head go unpriced); 0 prices copies as free, "
        "so every copy that levels the ranks is made",
    )  # fmt: skip
    balance_batch: int = _option(
        1, "sequences one decode step is priced at when the solvers balance it: each head's "
        "attention grows with them, the projection rows a copy repeats do not, so copies pay "
        "only at a large batch (FairKV's regime); 1 prices one request's decode",
    )  # fmt: skip
    seed: int = _option(0, "seed of the random and genetic solvers")

    def __post_init__(self):
        for name in ("gpus", "replicas", "seed", "balance_batch"):
            value, least = getattr(self, name), 1 if name in ("gpus", "balance_batch") else 0
            if type(value) is not int or value < least:
                raise UserError(f"{name} must be an integer >= {least}, got {value!r}")
        copy = self.copy_seconds
        if copy is not None and not (type(copy) in (int, float) and 0 <= copy < math.inf):
            raise UserError(f"copy_seconds must be a number >= 0, got {self.copy_seconds!r}")
        for name, choices in (("balance", SOLVERS), ("balance_phase", PHASES)):
            if getattr(self, name) not in choices:
                raise UserError(f"{name} must be one of {', '.join(choices)}, "
                                f"got {getattr(self, name)!r}")  # fmt: skip

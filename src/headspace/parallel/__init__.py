"""Head-parallel execution over several GPUs: which rank computes which kv head.

``assignment`` holds the per-layer assignment of kv heads to ranks (with fair-copying: a
head's attention divided between copies on several ranks) and its load arithmetic;
``solvers`` (one file each) search for an assignment that balances the ranks' loads. Both are
pure Python over per-head costs (``planner.head_cost``), testable without a process group.
"""

from headspace.parallel.assignment import (
    HeadCost,
    LayerAssignment,
    balance_summary,
    check_assignment,
    rank_loads,
)
from headspace.parallel.solvers import SOLVERS, solve, solve_layers

__all__ = ["SOLVERS", "HeadCost", "LayerAssignment", "balance_summary", "check_assignment",
           "rank_loads", "solve", "solve_layers"]  # fmt: skip

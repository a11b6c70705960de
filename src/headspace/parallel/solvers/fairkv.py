"""FairKV: best-effort assignment, then fair-copying. The heads go out longest first to the
least loaded rank (greedy); then, up to ``replicas`` times, a head of the most loaded rank is
copied to the least loaded rank that lacks it and the copies divide its attention so their
ranks end level (a token range each, merged by log-sum-exp, or a share of the batch rows).
A copy is kept only when it lowers the loads busiest first (the busiest rank's, or one
tied with it): the heaviest head first, then lighter ones. Starts from greedy's assignment,
so never worse than greedy."""

from __future__ import annotations

from collections.abc import Sequence

from headspace.parallel.assignment import (
    HeadCost,
    LayerAssignment,
    copy_budget,
    fill_shares,
    num_extra_copies,
    rank_loads,
)
from headspace.parallel.solvers import greedy

GAIN = 1e-9  # relative drop a copy must bring to the loads, busiest first


def solve(costs: Sequence[HeadCost], num_ranks: int, *, replicas: int = 0,
          seed: int = 0) -> LayerAssignment:  # fmt: skip
    assignment = greedy.solve(costs, num_ranks)
    budget = copy_budget(replicas, len(costs), num_ranks) - num_extra_copies(assignment)
    for _ in range(budget):
        copied = _copy_one(costs, assignment, num_ranks)
        if copied is None:
            break
        assignment = copied
    return assignment


def _descending(loads: list[float]) -> list[float]:
    return sorted(loads, reverse=True)


def _lower(new: list[float], old: list[float]) -> bool:
    """Whether ``new`` loads, busiest first, come before ``old`` (lexicographically, by more
    than ``GAIN``): the busiest load drops, or stays while a rank tied with it drops."""
    for a, b in zip(_descending(new), _descending(old), strict=True):
        if a < b * (1 - GAIN):
            return True
        if a > b * (1 + GAIN):
            return False
    return False


def _copy_one(costs: Sequence[HeadCost], assignment: LayerAssignment,
              num_ranks: int) -> LayerAssignment | None:  # fmt: skip
    """The assignment with one more copy of a head of a busiest rank (ties included) that
    lowers the loads busiest first (so ties are undone one copy at a time), or None."""
    loads = rank_loads(costs, assignment, num_ranks)
    peak = max(loads)
    busiest = {rank for rank, load in enumerate(loads) if load >= peak * (1 - GAIN)}
    on_busiest = [h for h, copies in enumerate(assignment) if any(r in busiest for r, _ in copies)]
    for head in sorted(on_busiest, key=lambda h: -costs[h].split):
        holders = {rank for rank, _ in assignment[head]}
        free = [rank for rank in range(num_ranks) if rank not in holders]
        if not free:
            continue
        target = min(free, key=lambda r: (loads[r], r))
        grown = list(assignment)
        grown[head] = (*assignment[head], (target, 0.0))
        candidate = fill_shares(costs, tuple(grown), num_ranks)
        if _lower(rank_loads(costs, candidate, num_ranks), loads):
            return candidate
    return None

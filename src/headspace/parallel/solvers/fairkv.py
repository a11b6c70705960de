"""FairKV: best-effort assignment, then fair-copying. The heads go out longest first to the
least loaded rank (greedy); then, up to ``replicas`` times, a head of the most loaded rank is
copied to the least loaded rank that lacks it and the copies divide its attention so their
ranks end level (a token range each, merged by log-sum-exp, or a share of the batch rows).
A copy is kept only when it lowers the busiest rank's load, or that of a rank tied with it
(over several phases: the sum of their busiest ranks, then each rank's load busiest first),
the heaviest head first, then lighter ones. A copy adds its head's ``copy`` seconds to each
rank that holds one (its own launches and merge), so a head is divided only where that
pays. Starts from greedy's assignment, so never worse than greedy."""

from __future__ import annotations

from headspace.parallel.assignment import (
    Costs,
    LayerAssignment,
    LayerCosts,
    copy_budget,
    fill_shares,
    improves,
    num_extra_copies,
    score,
)
from headspace.parallel.solvers import greedy


def solve(costs: Costs, num_ranks: int, *, replicas: int = 0, seed: int = 0) -> LayerAssignment:
    layer = LayerCosts.of(costs)
    assignment = greedy.solve(layer, num_ranks)
    budget = copy_budget(replicas, layer.num_heads, num_ranks) - num_extra_copies(assignment)
    for _ in range(budget):
        copied = _copy_one(layer, assignment, num_ranks)
        if copied is None:
            break
        assignment = copied
    return assignment


def _copy_one(layer: LayerCosts, assignment: LayerAssignment,
              num_ranks: int) -> LayerAssignment | None:  # fmt: skip
    """The assignment with one more copy of a head of a busiest rank (of any phase, ties
    included) that lowers the loads' :func:`score` (so ties are undone one copy at a time),
    or None. A copy's share divides every phase's attention alike (the phases' weighted sum
    is what its shares level)."""
    loads = layer.loads(assignment, num_ranks)  # [phase][rank]
    now = score(loads)
    busiest = {r for row in loads for r, x in enumerate(row) if x >= max(row) * (1 - 1e-12)}
    on_busiest = [h for h, copies in enumerate(assignment) if any(r in busiest for r, _ in copies)]
    combined = layer.combined()
    total = [sum(row[r] for row in loads) for r in range(num_ranks)]
    for head in sorted(on_busiest, key=lambda h: -combined[h].split):
        if combined[head].split <= 0:  # nothing a copy could divide
            continue
        holders = {rank for rank, _ in assignment[head]}
        free = [rank for rank in range(num_ranks) if rank not in holders]
        if not free:
            continue
        target = min(free, key=lambda r: (total[r], r))
        grown = list(assignment)
        grown[head] = (*assignment[head], (target, 0.0))
        candidate = fill_shares(combined, tuple(grown), num_ranks)
        kept = target in {rank for rank, _ in candidate[head]}  # not dropped for no share
        if kept and improves(score(layer.loads(candidate, num_ranks)), now):
            return candidate
    return None

"""Greedy: longest processing time first, then local moves. Heads by decreasing cost, each to
the rank with the least load so far (within 4/3 of the optimum); then, while it lowers the
most loaded rank, one of its heads moves to another rank or swaps with a lighter head there.
The contiguous split (uniform) is kept instead when it is better, so greedy is never worse
than uniform. The unit is a kv head with its query heads: a GQA group is never split."""

from __future__ import annotations

from collections.abc import Sequence

from headspace.parallel.assignment import HeadCost, LayerAssignment, makespan, single
from headspace.parallel.solvers import uniform


def lpt_ranks(costs: Sequence[HeadCost], num_ranks: int) -> list[int]:
    """Rank of each head under longest-processing-time-first (ties: the lower rank)."""
    loads, ranks = [0.0] * num_ranks, [0] * len(costs)
    for head in sorted(range(len(costs)), key=lambda h: (-costs[h].total, h)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        ranks[head], loads[rank] = rank, loads[rank] + costs[head].total
    return ranks


def improve(costs: Sequence[HeadCost], ranks: list[int], num_ranks: int) -> list[int]:
    """``ranks`` after moves and swaps out of the most loaded rank, each lowering the pair's
    larger load, until none does (a local optimum)."""
    work = [cost.total for cost in costs]
    ranks = list(ranks)
    loads = [0.0] * num_ranks
    for head, rank in enumerate(ranks):
        loads[rank] += work[head]
    while True:
        busiest = max(range(num_ranks), key=lambda r: loads[r])
        move = _best_move(work, ranks, loads, busiest)
        if move is None:
            return ranks
        head, other, swap = move
        loads[busiest] += (work[swap] if swap is not None else 0.0) - work[head]
        loads[other] += work[head] - (work[swap] if swap is not None else 0.0)
        ranks[head] = other
        if swap is not None:
            ranks[swap] = busiest


def _best_move(work: list[float], ranks: list[int], loads: list[float], busiest: int):
    """(head on the busiest rank, rank it goes to, head swapped back or None) that most
    lowers the larger of the two ranks' loads below the busiest's, or None."""
    best, best_peak = None, loads[busiest] * (1 - 1e-12)
    mine = [h for h, r in enumerate(ranks) if r == busiest]
    for other in range(len(loads)):
        if other == busiest:
            continue
        theirs = [None] + [h for h, r in enumerate(ranks) if r == other]
        for head in mine:
            for swap in theirs:
                delta = work[head] - (work[swap] if swap is not None else 0.0)
                peak = max(loads[busiest] - delta, loads[other] + delta)
                if delta > 0 and peak < best_peak:
                    best, best_peak = (head, other, swap), peak
    return best


def solve(costs: Sequence[HeadCost], num_ranks: int, *, replicas: int = 0,
          seed: int = 0) -> LayerAssignment:  # fmt: skip
    searched = single(improve(costs, lpt_ranks(costs, num_ranks), num_ranks))
    contiguous = uniform.solve(costs, num_ranks)
    if makespan(costs, contiguous, num_ranks) < makespan(costs, searched, num_ranks):
        return contiguous
    return searched

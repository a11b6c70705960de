"""Exact: the assignment with one copy per head and the smallest most-loaded rank, by branch
and bound: heads in decreasing cost, a branch cut when its load reaches the best found, and a
head tried on at most one empty rank (ranks are interchangeable). Optimal among single-copy
assignments; uniform's copies are kept instead when better (fewer heads than ranks). For
small layers: the search grows as ranks ** heads in the worst case."""

from __future__ import annotations

from collections.abc import Sequence

from headspace.parallel.assignment import HeadCost, LayerAssignment, makespan, single
from headspace.parallel.solvers import greedy, uniform

MAX_HEADS = 16  # above this, refuse rather than search for minutes


def solve(costs: Sequence[HeadCost], num_ranks: int, *, replicas: int = 0,
          seed: int = 0) -> LayerAssignment:  # fmt: skip
    if len(costs) > MAX_HEADS:
        raise ValueError(f"exact search takes at most {MAX_HEADS} heads a layer, got {len(costs)}")
    order = sorted(range(len(costs)), key=lambda h: -costs[h].total)
    work = [costs[h].total for h in order]
    best_ranks = greedy.improve(costs, greedy.lpt_ranks(costs, num_ranks), num_ranks)
    best = makespan(costs, single(best_ranks), num_ranks)
    lower = max(max(work, default=0.0), sum(work) / num_ranks)
    loads, counts, chosen = [0.0] * num_ranks, [0] * num_ranks, [0] * len(order)

    def search(index: int, peak: float) -> None:
        nonlocal best, best_ranks
        if peak >= best * (1 - 1e-12) or best <= lower * (1 + 1e-12):
            return
        if index == len(order):
            best, best_ranks = peak, [0] * len(order)
            for position, head in enumerate(order):
                best_ranks[head] = chosen[position]
            return
        seen_empty = False
        for rank in range(num_ranks):
            if counts[rank] == 0:
                if seen_empty:
                    continue
                seen_empty = True
            loads[rank] += work[index]
            counts[rank] += 1
            chosen[index] = rank
            search(index + 1, max(peak, loads[rank]))
            loads[rank] -= work[index]
            counts[rank] -= 1

    search(0, 0.0)
    contiguous = uniform.solve(costs, num_ranks)
    if makespan(costs, contiguous, num_ranks) < best:
        return contiguous
    return single(best_ranks)

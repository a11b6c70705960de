"""FairKV's copy-scheme search (the paper's Algorithms 1 and 2), exhaustive where the
fairkv solver copies one head at a time. Algorithm 1: every way to give the layer's heads
extra copies within its budget (a head in ``n`` copies on ``n`` distinct ranks, each taking
``1/n`` of its divisible work). Algorithm 2: each scheme's copies placed over the ranks and
the best scheme kept; here the placement is exact's branch and bound (:func:`place`) on
the score the other solvers use (the sum of each phase's most loaded rank, a divided
head's ``copy`` seconds on each rank that holds it), where the paper compares the spread
between the heaviest and the lightest group. The winner's shares are then levelled
(:func:`fill_shares`). Seeded with fairkv's assignment, so never worse than it. For small
layers: the schemes grow as ``heads ** copies`` and each placement as ``ranks ** (heads +
copies)``."""

from __future__ import annotations

from collections.abc import Iterator

from headspace.parallel.assignment import (
    Costs,
    LayerAssignment,
    LayerCosts,
    copy_budget,
    fill_shares,
    makespan,
)
from headspace.parallel.solvers import fairkv
from headspace.parallel.solvers.exact import place

MAX_COPIES = 16  # heads and extra copies of a layer: above this, refuse rather than search


def check(num_heads: int, num_ranks: int, replicas: int) -> int:
    """The extra copies a layer of ``num_heads`` may make over ``num_ranks``; ValueError for
    a layer too large to search."""
    budget = min(copy_budget(replicas, num_heads, num_ranks), num_heads * (num_ranks - 1))
    if num_heads + budget > MAX_COPIES:
        raise ValueError(f"copy search takes at most {MAX_COPIES} heads and extra copies a "
                         f"layer, got {num_heads} + {budget}")  # fmt: skip
    return budget


def solve(costs: Costs, num_ranks: int, *, replicas: int = 0, seed: int = 0) -> LayerAssignment:
    layer = LayerCosts.of(costs)
    budget = check(layer.num_heads, num_ranks, replicas)
    best = fairkv.solve(layer, num_ranks, replicas=replicas)
    best_cost = makespan(layer, best, num_ranks)
    combined = layer.combined()
    for counts in schemes(layer.num_heads, budget, num_ranks):
        placed = place(layer, counts, num_ranks, best_cost)
        if placed is None:
            continue
        candidate = fill_shares(combined, placed, num_ranks)
        cost = makespan(layer, candidate, num_ranks)
        if cost < best_cost * (1 - 1e-12):
            best, best_cost = candidate, cost
    return best


def schemes(num_heads: int, budget: int, num_ranks: int) -> Iterator[tuple[int, ...]]:
    """Algorithm 1: every count of copies per head (1 to ``num_ranks`` each) with at most
    ``budget`` copies beyond one a head, by backtracking over the heads."""
    counts = [1] * num_heads

    def backtrack(head: int, left: int) -> Iterator[tuple[int, ...]]:
        if head == num_heads:
            yield tuple(counts)
            return
        for extra in range(min(left, num_ranks - 1) + 1):
            counts[head] = 1 + extra
            yield from backtrack(head + 1, left - extra)
        counts[head] = 1

    yield from backtrack(0, budget)

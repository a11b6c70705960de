"""Exact: the assignment with one copy per head and the smallest most-loaded rank, by branch
and bound: heads in decreasing cost, a branch cut when its load reaches the best found, and a
head tried on at most one empty rank (ranks are interchangeable). Over several phases at once
(``LayerCosts``) it minimises the weighted sum of the phases' most loaded ranks. Optimal
among single-copy assignments; uniform's copies are kept instead when better (fewer heads
than ranks). For small layers: the search grows as ranks ** heads in the worst case."""

from __future__ import annotations

from headspace.parallel.assignment import Costs, LayerAssignment, LayerCosts, makespan, single
from headspace.parallel.solvers import greedy, uniform

MAX_HEADS = 16  # above this, refuse rather than search for minutes


def solve(costs: Costs, num_ranks: int, *, replicas: int = 0, seed: int = 0) -> LayerAssignment:
    layer = LayerCosts.of(costs)
    if layer.num_heads > MAX_HEADS:
        raise ValueError(f"exact search takes at most {MAX_HEADS} heads a layer, "
                         f"got {layer.num_heads}")  # fmt: skip
    by_head = layer.work()  # [head][phase]
    order = sorted(range(len(by_head)), key=lambda h: -sum(by_head[h]))
    work = [by_head[h] for h in order]
    num_phases = layer.num_phases
    best_ranks = greedy.improve(layer, greedy.lpt_ranks(layer, num_ranks), num_ranks)
    best = makespan(layer, single(best_ranks), num_ranks)
    lower = sum(max(max((w[p] for w in work), default=0.0), sum(w[p] for w in work) / num_ranks)
                for p in range(num_phases))  # fmt: skip
    loads = [[0.0] * num_phases for _ in range(num_ranks)]  # [rank][phase]
    counts, chosen = [0] * num_ranks, [0] * len(order)

    def search(index: int, peaks: list[float]) -> None:
        nonlocal best, best_ranks
        if sum(peaks) >= best * (1 - 1e-12) or best <= lower * (1 + 1e-12):
            return
        if index == len(order):
            best, best_ranks = sum(peaks), [0] * len(order)
            for position, head in enumerate(order):
                best_ranks[head] = chosen[position]
            return
        seen_empty = False
        for rank in range(num_ranks):
            if counts[rank] == 0:
                if seen_empty:
                    continue
                seen_empty = True
            loads[rank] = [x + w for x, w in zip(loads[rank], work[index], strict=True)]
            counts[rank] += 1
            chosen[index] = rank
            search(index + 1, [max(p, x) for p, x in zip(peaks, loads[rank], strict=True)])
            loads[rank] = [x - w for x, w in zip(loads[rank], work[index], strict=True)]
            counts[rank] -= 1

    search(0, [0.0] * num_phases)
    contiguous = uniform.solve(layer.phases[0], num_ranks)
    if makespan(layer, contiguous, num_ranks) < best:
        return contiguous
    return single(best_ranks)

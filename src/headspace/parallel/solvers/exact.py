"""Exact: the assignment with one copy per head and the smallest most-loaded rank, by branch
and bound: heads in decreasing cost, a branch cut when its load reaches the best found, and a
head tried on at most one empty rank (ranks are interchangeable). Over several phases at once
(``LayerCosts``) it minimises the weighted sum of the phases' most loaded ranks. Optimal
among single-copy assignments; uniform's copies are kept instead when better (fewer heads
than ranks). For small layers: the search grows as ranks ** heads in the worst case."""

from __future__ import annotations

from collections.abc import Sequence

from headspace.parallel.assignment import Costs, LayerAssignment, LayerCosts, makespan, single
from headspace.parallel.solvers import greedy, uniform

MAX_HEADS = 16  # above this, refuse rather than search for minutes


def check(num_heads: int) -> None:
    """ValueError for a layer too large to search."""
    if num_heads > MAX_HEADS:
        raise ValueError(f"exact search takes at most {MAX_HEADS} heads a layer, "
                         f"got {num_heads}")  # fmt: skip


def solve(costs: Costs, num_ranks: int, *, replicas: int = 0, seed: int = 0) -> LayerAssignment:
    layer = LayerCosts.of(costs)
    check(layer.num_heads)
    best = single(greedy.improve(layer, greedy.lpt_ranks(layer, num_ranks), num_ranks))
    placed = place(layer, (1,) * layer.num_heads, num_ranks, makespan(layer, best, num_ranks))
    best = best if placed is None else placed
    contiguous = uniform.solve(layer.phases[0], num_ranks)
    if makespan(layer, contiguous, num_ranks) < makespan(layer, best, num_ranks):
        return contiguous
    return best


def place(layer: LayerCosts, counts: Sequence[int], num_ranks: int,
          bound: float) -> LayerAssignment | None:  # fmt: skip
    """Head ``h`` in ``counts[h]`` copies, each with ``1 / counts[h]`` of its divisible work
    (and its ``copy`` seconds when divided), on distinct ranks, so that the sum of each
    phase's most loaded rank is least; None if no placement beats ``bound``. Branch and
    bound: copies in decreasing work, a branch cut once it reaches the best found or the
    search once the best meets the lower bound, an empty rank tried once (empty ranks are
    interchangeable)."""
    items = []  # (head, work [phase]) per copy
    for head, phases in enumerate(zip(*layer.phases, strict=True)):
        n = counts[head]
        work = [w * (c.fixed + c.split / n + (c.copy if n > 1 else 0.0))
                for w, c in zip(layer.weights, phases, strict=True)]  # fmt: skip
        items += [(head, work)] * n
    items.sort(key=lambda item: -sum(item[1]))
    phases = range(layer.num_phases)
    lower = sum(max(max((w[p] for _, w in items), default=0.0),
                    sum(w[p] for _, w in items) / num_ranks) for p in phases)  # fmt: skip
    loads = [[0.0] * layer.num_phases for _ in range(num_ranks)]  # [rank][phase]
    sizes = [0] * num_ranks  # copies on each rank
    holders: list[set[int]] = [set() for _ in range(layer.num_heads)]
    chosen = [0] * len(items)
    best: list = [bound, None]  # (the cost to beat, the ranks of the copies)

    def search(index: int, peaks: list[float]) -> None:
        if sum(peaks) >= best[0] * (1 - 1e-12) or best[0] <= lower * (1 + 1e-12):
            return
        if index == len(items):
            best[0], best[1] = sum(peaks), list(chosen)
            return
        head, work = items[index]
        seen_empty = False
        for rank in range(num_ranks):
            if rank in holders[head]:
                continue
            if sizes[rank] == 0:
                if seen_empty:
                    continue
                seen_empty = True
            loads[rank] = [x + w for x, w in zip(loads[rank], work, strict=True)]
            sizes[rank] += 1
            holders[head].add(rank)
            chosen[index] = rank
            search(index + 1, [max(p, x) for p, x in zip(peaks, loads[rank], strict=True)])
            loads[rank] = [x - w for x, w in zip(loads[rank], work, strict=True)]
            sizes[rank] -= 1
            holders[head].discard(rank)

    search(0, [0.0] * layer.num_phases)
    if best[1] is None:
        return None
    copies: list[list] = [[] for _ in range(layer.num_heads)]
    for (head, _), rank in zip(items, best[1], strict=True):
        copies[head].append((rank, 1.0 / counts[head]))
    return tuple(tuple(head_copies) for head_copies in copies)

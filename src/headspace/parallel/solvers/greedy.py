"""Greedy: longest processing time first, then local moves. Heads by decreasing cost, each to
the rank with the least load so far (over one phase, within 4/3 of the optimum); then, while
it lowers the most loaded rank (or one tied with it), one of its heads moves to another rank
or swaps with a lighter head there. Over several phases at once (``LayerCosts``) a head goes
where it raises the weighted sum of the phases' most loaded ranks least, and a move must
lower that sum, or keep it and lower the ranks' loads busiest first (``score``). The
contiguous split (uniform) is kept instead when it is better, so greedy is never worse than
uniform. The unit is a kv head with its query heads: a GQA group is never split."""

from __future__ import annotations

import math

from headspace.parallel.assignment import (
    Costs,
    LayerAssignment,
    LayerCosts,
    improves,
    makespan,
    placed_loads,
    score,
    single,
)
from headspace.parallel.solvers import uniform

MAX_MOVES = 10_000  # each move improves the score; a bound against rounding's ties all the same


def lpt_ranks(costs: Costs, num_ranks: int) -> list[int]:
    """Rank of each head under longest-processing-time-first (ties: the lower rank)."""
    layer = LayerCosts.of(costs)
    work = layer.work()  # [head][phase]
    loads = [[0.0] * layer.num_phases for _ in range(num_ranks)]  # [rank][phase]
    peaks, ranks = [0.0] * layer.num_phases, [0] * len(work)
    for head in sorted(range(len(work)), key=lambda h: (-sum(work[h]), h)):
        rank = min(range(num_ranks), key=lambda r: (_rise(peaks, loads[r], work[head]),
                                                     sum(loads[r]), r))  # fmt: skip
        loads[rank] = [x + w for x, w in zip(loads[rank], work[head], strict=True)]
        peaks = [max(p, x) for p, x in zip(peaks, loads[rank], strict=True)]
        ranks[head] = rank
    return ranks


def _rise(peaks: list[float], loads: list[float], work: list[float]) -> float:
    """The phases' summed peaks once ``work`` joins a rank holding ``loads``."""
    return sum(max(p, x + w) for p, x, w in zip(peaks, loads, work, strict=True))


def improve(costs: Costs, ranks: list[int], num_ranks: int) -> list[int]:
    """``ranks`` after moves and swaps out of a most loaded rank (of any phase), each lowering
    the phases' summed peaks or, where those tie, levelling the ranks, until none does (a
    local optimum)."""
    work = LayerCosts.of(costs).work()
    ranks = list(ranks)
    loads = placed_loads(work, ranks, num_ranks)  # [rank][phase]
    for _ in range(MAX_MOVES):
        move = _best_move(work, ranks, loads)
        if move is None:
            break
        head, other, swap = move
        source = ranks[head]
        loads[source], loads[other] = _moved(work, loads, source, other, head, swap)
        ranks[head] = other
        if swap is not None:
            ranks[swap] = source
    return ranks


def _moved(work, loads, source: int, other: int, head: int, swap: int | None):
    """The two ranks' loads after ``head`` moves from ``source`` to ``other`` (and ``swap``
    back)."""
    back = work[swap] if swap is not None else [0.0] * len(work[head])
    delta = [a - b for a, b in zip(work[head], back, strict=True)]
    return ([x - d for x, d in zip(loads[source], delta, strict=True)],
            [x + d for x, d in zip(loads[other], delta, strict=True)])  # fmt: skip


def _best_move(work: list[list[float]], ranks: list[int], loads: list[list[float]]):
    """(head on a most loaded rank, rank it goes to, head swapped back or None) that improves
    the loads' :func:`score`, the pair of ranks it changes ending lowest (over the phases,
    the sum of each phase's larger load), or None. The most loaded rank of each phase (the
    first, where ranks tie) gives heads: over one phase, the classic move-or-swap search."""
    by_phase = list(zip(*loads, strict=True))  # [phase][rank]
    now = score(by_phase)
    sources = dict.fromkeys(max(range(len(row)), key=row.__getitem__) for row in by_phase)
    best, best_pair = None, math.inf
    for source, head, other, swap in _candidates(ranks, sources, len(loads)):
        trial = list(loads)
        trial[source], trial[other] = _moved(work, loads, source, other, head, swap)
        pair = sum(map(max, trial[source], trial[other]))
        if pair < best_pair and improves(score(list(zip(*trial, strict=True))), now):
            best, best_pair = (head, other, swap), pair
    return best


def _candidates(ranks: list[int], sources, num_ranks: int):
    """(source rank, its head, other rank, head there to swap back or None) for every move
    and swap out of ``sources``."""
    for source in sources:
        mine = [h for h, r in enumerate(ranks) if r == source]
        for other in (r for r in range(num_ranks) if r != source):
            theirs = [None] + [h for h, r in enumerate(ranks) if r == other]
            yield from ((source, head, other, swap) for head in mine for swap in theirs)


def solve(costs: Costs, num_ranks: int, *, replicas: int = 0, seed: int = 0) -> LayerAssignment:
    searched = single(improve(costs, lpt_ranks(costs, num_ranks), num_ranks))
    contiguous = uniform.solve(LayerCosts.of(costs).phases[0], num_ranks)
    if makespan(costs, contiguous, num_ranks) < makespan(costs, searched, num_ranks):
        return contiguous
    return searched

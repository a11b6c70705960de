"""Assignments of one layer's kv heads to ranks, and the loads they put on each rank.

A kv head (with its query heads) is the unit of work: its ``HeadCost`` has a part that copies
divide between them (attention over its K/V: each copy attends a token range, merged by
log-sum-exp, or a share of the batch rows) and a part every copy repeats (its projections).
An assignment lists, per kv head, its copies as ``(rank, share)`` pairs whose shares sum to 1;
a divided head's copies each add its ``copy`` seconds. A step waits for the slowest rank at
every layer (the partial outputs are all-reduced), so a model's step time is the sum over
layers of the most loaded rank's load. The solvers may balance several phases at once
(``LayerCosts``): an assignment then costs the weighted sum of each phase's slowest rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from headspace.planner.head_cost import HeadCost

Copy = tuple[int, float]  # (rank, share of the head's divisible work)
LayerAssignment = tuple[tuple[Copy, ...], ...]  # per kv head of a layer: its copies


def single(ranks: Sequence[int]) -> LayerAssignment:
    """The assignment computing head ``h`` on ``ranks[h]`` alone."""
    return tuple(((rank, 1.0),) for rank in ranks)


def rank_loads(costs: Sequence[HeadCost], assignment: LayerAssignment,
               num_ranks: int) -> list[float]:  # fmt: skip
    """Seconds of work each rank does for one layer."""
    loads = [0.0] * num_ranks
    for cost, copies in zip(costs, assignment, strict=True):
        overhead = cost.copy if len(copies) > 1 else 0.0
        for rank, share in copies:
            loads[rank] += cost.fixed + share * cost.split + overhead
    return loads


@dataclass(frozen=True)
class LayerCosts:
    """One layer's kv heads' costs in each phase balanced at once, and each phase's weight:
    an assignment costs the weighted sum of each phase's most loaded rank (a plain list of
    ``HeadCost`` is one phase of weight 1, where that cost is the makespan)."""

    phases: tuple[tuple[HeadCost, ...], ...]  # [phase][kv head]
    weights: tuple[float, ...]  # per phase (e.g. 1 / the phase's total seconds)

    @classmethod
    def of(cls, costs: Costs) -> LayerCosts:
        return costs if isinstance(costs, LayerCosts) else cls((tuple(costs),), (1.0,))

    @property
    def num_heads(self) -> int:
        return len(self.phases[0])

    @property
    def num_phases(self) -> int:
        return len(self.phases)

    def work(self) -> list[list[float]]:
        """``[kv head][phase]``: each head's weighted seconds, undivided."""
        return [[w * c.total for w, c in zip(self.weights, head, strict=True)]
                for head in zip(*self.phases, strict=True)]  # fmt: skip

    def loads(self, assignment: LayerAssignment, num_ranks: int) -> list[list[float]]:
        """``[phase][rank]``: each rank's weighted seconds in each phase."""
        return [[w * load for load in rank_loads(costs, assignment, num_ranks)]
                for w, costs in zip(self.weights, self.phases, strict=True)]  # fmt: skip

    def combined(self) -> list[HeadCost]:
        """One cost per head: the phases' weighted sum (what a copy's share divides)."""
        return [HeadCost(*(sum(w * getattr(c, part) for w, c in zip(self.weights, head,
                                                                    strict=True))
                           for part in ("split", "fixed", "copy")))
                for head in zip(*self.phases, strict=True)]  # fmt: skip


Costs = Sequence[HeadCost] | LayerCosts


def placed_loads(work: Sequence[Sequence[float]], ranks: Sequence[int],
                 num_ranks: int) -> list[list[float]]:  # fmt: skip
    """``[rank][phase]`` loads of heads placed one copy each on ``ranks``, from their
    ``work [head][phase]`` (:meth:`LayerCosts.work`)."""
    loads = [[0.0] * (len(work[0]) if work else 1) for _ in range(num_ranks)]
    for head, rank in enumerate(ranks):
        row = loads[rank]
        for phase, w in enumerate(work[head]):
            row[phase] += w
    return loads


def score(loads: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """``loads [phase][rank]`` -> (the sum of each phase's most loaded rank, then each rank's
    load summed over the phases, largest first): lower is better, compared in that order
    (:func:`improves`), so where the slowest ranks tie, lowering one of the tied ranks
    counts (ties are undone one move or copy at a time)."""
    by_rank = sorted((sum(column) for column in zip(*loads, strict=True)), reverse=True)
    return (sum(max(row) for row in loads), *by_rank)


def improves(new: Sequence[float], old: Sequence[float], tol: float = 1e-12) -> bool:
    """Whether score ``new`` comes before ``old``, element by element, by more than rounding;
    the slowest ranks' sum must not rise at all for a later element to count."""
    if new[0] > old[0]:
        return False
    for a, b in zip(new, old, strict=True):
        if a < b * (1 - tol):
            return True
        if a > b * (1 + tol):
            return False
    return False


def makespan(costs: Costs, assignment: LayerAssignment, num_ranks: int) -> float:
    """The most loaded rank's seconds: the layer's time (the phases' weighted sum of them)."""
    return sum(max(row) for row in LayerCosts.of(costs).loads(assignment, num_ranks))


def num_extra_copies(assignment: LayerAssignment) -> int:
    """Copies beyond one per head."""
    return sum(len(copies) - 1 for copies in assignment)


def copy_budget(replicas: int, num_heads: int, num_ranks: int) -> int:
    """Extra copies a layer may make: ``replicas``, or as many as leave no rank without a
    head when the ranks outnumber the heads (tensor parallelism copies kv heads so too)."""
    return max(replicas, num_ranks - num_heads)


def check_assignment(assignment: LayerAssignment, num_heads: int, num_ranks: int,
                     replicas: int) -> None:  # fmt: skip
    """ValueError unless every head is computed, on distinct valid ranks, its shares are
    positive and sum to 1, and the extra copies stay within :func:`copy_budget`."""
    if len(assignment) != num_heads:
        raise ValueError(f"{len(assignment)} heads assigned, expected {num_heads}")
    for head, copies in enumerate(assignment):
        ranks = [rank for rank, _ in copies]
        if not copies or len(set(ranks)) != len(ranks):
            raise ValueError(f"head {head}: no copy, or two copies on one rank: {copies}")
        if any(not 0 <= rank < num_ranks for rank in ranks):
            raise ValueError(f"head {head}: a rank outside 0..{num_ranks - 1}: {copies}")
        if any(share <= 0 for _, share in copies) or abs(sum(s for _, s in copies) - 1) > 1e-9:
            raise ValueError(f"head {head}: shares must be positive and sum to 1: {copies}")
    budget = copy_budget(replicas, num_heads, num_ranks)
    if num_extra_copies(assignment) > budget:
        raise ValueError(f"{num_extra_copies(assignment)} extra copies, budget {budget}")


def fill_shares(costs: Sequence[HeadCost], assignment: LayerAssignment,
                num_ranks: int, rounds: int = 8) -> LayerAssignment:  # fmt: skip
    """The assignment with each replicated head's shares re-divided so that its copies' ranks
    end as level as its work allows (water-filling, a few rounds over the replicated heads);
    a copy left with no share is dropped."""
    heads = [list(copies) for copies in assignment]
    for _ in range(rounds):
        for head, copies in enumerate(heads):
            if len(copies) < 2 or costs[head].split <= 0:
                continue
            loads = rank_loads(costs, tuple(tuple(c) for c in heads), num_ranks)
            split = costs[head].split
            base = {rank: loads[rank] - share * split for rank, share in copies}
            level = _water_level(sorted(base.values()), split)
            shares = {rank: max(0.0, level - b) / split for rank, b in base.items()}
            top = max(shares.values())
            kept = [(rank, s) for rank, s in shares.items() if s > 1e-9 * top]
            total = sum(s for _, s in kept)
            if total > 0 and math.isfinite(total):
                heads[head] = [(rank, s / total) for rank, s in kept]
            else:  # a vanishing split: its shares stand, less a copy that has none
                heads[head] = [(rank, s) for rank, s in copies if s > 0]
    return tuple(tuple(copies) for copies in heads)


def _water_level(bases: list[float], amount: float) -> float:
    """The level L with sum(max(0, L - b)) == amount over ascending ``bases``."""
    level = bases[0] + amount
    for count in range(1, len(bases) + 1):
        level = (sum(bases[:count]) + amount) / count
        if count == len(bases) or level <= bases[count]:
            break
    return level


def balance_summary(costs: Sequence[Sequence[HeadCost]], assignments: Sequence[LayerAssignment],
                    num_ranks: int) -> dict:  # fmt: skip
    """Loads over all layers: ``rank_seconds`` (each rank's sum), ``step_seconds`` (the sum of
    each layer's most loaded rank: what the step waits for), ``imbalance_max_over_mean`` (that
    over the sum of each layer's mean load: 1.0 is perfect balance) and ``extra_copies``."""
    totals, step, mean = [0.0] * num_ranks, 0.0, 0.0
    for layer_costs, assignment in zip(costs, assignments, strict=True):
        loads = rank_loads(layer_costs, assignment, num_ranks)
        totals = [t + load for t, load in zip(totals, loads, strict=True)]
        step, mean = step + max(loads), mean + sum(loads) / num_ranks
    return {"rank_seconds": totals, "step_seconds": step,
            "imbalance_max_over_mean": step / mean if mean else 1.0,
            "extra_copies": sum(num_extra_copies(a) for a in assignments)}  # fmt: skip

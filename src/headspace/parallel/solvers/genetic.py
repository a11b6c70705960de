"""Genetic search (FlexAttn): a population of assignments (a rank per head) evolved by
tournament selection, uniform crossover and mutation (a head moved, or two heads swapped),
the best kept unchanged each generation (elitism); the fittest polished by greedy's moves and
swaps at the end. Seeded with the greedy search's heads, and
greedy's assignment is kept when the search does not beat it, so it is never worse than
greedy (nor uniform); deterministic for a seed. Over several phases at once (``LayerCosts``)
the fitness is the weighted sum of the phases' most loaded ranks."""

from __future__ import annotations

import random
from dataclasses import dataclass

from headspace.parallel.assignment import (
    Costs,
    LayerAssignment,
    LayerCosts,
    makespan,
    placed_loads,
    single,
)
from headspace.parallel.solvers import greedy


@dataclass(frozen=True)
class GeneticConfig:
    """The search's sizes and rates."""

    population: int = 48
    generations: int = 150
    elite: int = 2  # best assignments carried over unchanged
    tournament: int = 3  # candidates drawn per parent; the fittest becomes the parent
    mutation: float = 0.9  # chance a child is mutated (a move or a swap): high, since
    # crossover of assignments whose ranks are labelled differently mixes little


def solve(costs: Costs, num_ranks: int, *, replicas: int = 0, seed: int = 0,
          config: GeneticConfig = GeneticConfig()) -> LayerAssignment:  # fmt: skip
    work = LayerCosts.of(costs).work()  # [head][phase]
    if not work:
        return ()
    draw = random.Random(seed)

    def fitness(ranks: list[int]) -> float:  # the phases' peaks, lower is fitter
        return sum(map(max, zip(*placed_loads(work, ranks, num_ranks), strict=True)))

    population = [greedy.improve(costs, greedy.lpt_ranks(costs, num_ranks), num_ranks)]
    population += [[draw.randrange(num_ranks) for _ in work] for _ in range(config.population - 1)]
    scored = sorted((fitness(ranks), ranks) for ranks in population)
    for _ in range(config.generations):
        children = [ranks for _, ranks in scored[: config.elite]]
        while len(children) < config.population:
            mother, father = (_pick(scored, config.tournament, draw) for _ in range(2))
            child = [m if draw.random() < 0.5 else f for m, f in zip(mother, father, strict=True)]
            if draw.random() < config.mutation:
                _mutate(child, num_ranks, draw)
            children.append(child)
        scored = sorted((fitness(ranks), ranks) for ranks in children)
    found = single(greedy.improve(costs, scored[0][1], num_ranks))  # polish the fittest
    start = greedy.solve(costs, num_ranks)
    return found if makespan(costs, found, num_ranks) < makespan(costs, start, num_ranks) else start


def _pick(scored: list[tuple[float, list[int]]], size: int, draw: random.Random) -> list[int]:
    """Tournament: the fittest of ``size`` drawn (``scored`` is sorted, fittest first)."""
    return scored[min(draw.sample(range(len(scored)), min(size, len(scored))))][1]


def _mutate(ranks: list[int], num_ranks: int, draw: random.Random) -> None:
    """Move one head to another rank, or swap the ranks of two heads."""
    head = draw.randrange(len(ranks))
    if draw.random() < 0.5:
        ranks[head] = draw.randrange(num_ranks)
    else:
        other = draw.randrange(len(ranks))
        ranks[head], ranks[other] = ranks[other], ranks[head]

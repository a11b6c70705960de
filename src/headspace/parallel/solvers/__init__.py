"""Solvers that assign a layer's kv heads to ranks (one file each), and their registry.

Every solver is ``solve(costs, num_ranks, *, replicas=0, seed=0) -> LayerAssignment`` over
the layer's ``HeadCost`` list, or its ``LayerCosts`` (several phases balanced at once); only
fairkv and copy_search use ``replicas`` (extra copies a layer may make); uniform, and
greedy, ga and exact where uniform's assignment is better, copy heads only when the ranks
outnumber them (``copy_budget``).
"""

from __future__ import annotations

from collections.abc import Sequence

from headspace.parallel.assignment import Costs, LayerAssignment
from headspace.parallel.solvers import (
    copy_search,
    exact,
    fairkv,
    genetic,
    greedy,
    random_assign,
    uniform,
)

SOLVERS = {"uniform": uniform.solve, "random": random_assign.solve, "greedy": greedy.solve,
           "ga": genetic.solve, "fairkv": fairkv.solve, "exact": exact.solve,
           "copy_search": copy_search.solve}  # fmt: skip


def solve(name: str, costs: Costs, num_ranks: int, *, replicas: int = 0,
          seed: int = 0) -> LayerAssignment:  # fmt: skip
    """One layer's assignment by solver ``name``."""
    if name not in SOLVERS:
        raise ValueError(f"balance must be one of {', '.join(SOLVERS)}, got {name!r}")
    if num_ranks < 1:
        raise ValueError(f"the number of ranks must be at least 1, got {num_ranks}")
    return SOLVERS[name](costs, num_ranks, replicas=replicas, seed=seed)


def check_limits(name: str, num_heads: int, num_ranks: int, replicas: int) -> None:
    """ValueError where solver ``name`` would refuse layers of ``num_heads`` kv heads over
    ``num_ranks`` ranks (its search's size limit), before any layer is solved."""
    if name == "exact":
        exact.check(num_heads)
    elif name == "copy_search":
        copy_search.check(num_heads, num_ranks, replicas)


def solve_layers(name: str, costs: Sequence[Costs], num_ranks: int, *,
                 replicas: int = 0, seed: int = 0) -> list[LayerAssignment]:  # fmt: skip
    """Each layer's assignment (``costs[layer][kv_head]``), solved layer by layer: each layer
    ends with an all-reduce, so the step waits for each layer's most loaded rank."""
    return [solve(name, layer_costs, num_ranks, replicas=replicas, seed=seed + layer)
            for layer, layer_costs in enumerate(costs)]  # fmt: skip

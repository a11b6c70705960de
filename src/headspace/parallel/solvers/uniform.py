"""Uniform: contiguous blocks of kv heads per rank, as tensor parallelism splits them; with
fewer heads than ranks each head is copied over ``ranks / heads`` ranks that share it evenly
(as tensor parallelism replicates kv heads). Blind to costs: the baseline."""

from __future__ import annotations

from headspace.parallel.assignment import Costs, LayerAssignment, LayerCosts, single


def solve(costs: Costs, num_ranks: int, *, replicas: int = 0,
          seed: int = 0) -> LayerAssignment:  # fmt: skip
    num_heads = LayerCosts.of(costs).num_heads
    if num_heads == 0:
        return ()
    if num_heads >= num_ranks:
        return single([head * num_ranks // num_heads for head in range(num_heads)])
    copies = [[] for _ in range(num_heads)]
    for rank in range(num_ranks):
        copies[rank * num_heads // num_ranks].append(rank)
    return tuple(tuple((rank, 1 / len(ranks)) for rank in ranks) for ranks in copies)

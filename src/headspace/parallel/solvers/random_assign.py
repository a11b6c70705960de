"""Random: each kv head on a rank drawn uniformly (seeded); a baseline for the searches."""

from __future__ import annotations

import random

from headspace.parallel.assignment import Costs, LayerAssignment, LayerCosts, single


def solve(costs: Costs, num_ranks: int, *, replicas: int = 0,
          seed: int = 0) -> LayerAssignment:  # fmt: skip
    draw = random.Random(seed)
    return single([draw.randrange(num_ranks) for _ in range(LayerCosts.of(costs).num_heads)])

"""A head map's ranks from its heads' costs: the chosen solver layer by layer, and the loads
it leaves (what ``headspace plan --gpus N`` prints and the engine follows)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from headspace.parallel.assignment import LayerAssignment, balance_summary
from headspace.parallel.config import ParallelConfig
from headspace.parallel.solvers import solve_layers
from headspace.planner.head_cost import CostShape, HeadCost, head_costs
from headspace.planner.head_map import HeadMap
from headspace.planner.memory import Hardware
from headspace.planner.profile import Profile, with_budget_shares
from headspace.planner.sparsity import with_budgets


@dataclass(frozen=True)
class Balance:
    """A solved assignment: the head map with ranks, and its loads per phase."""

    head_map: HeadMap
    phase: str  # the phase whose costs were balanced
    assignments: list[LayerAssignment]
    loads: dict[str, dict]  # phase -> balance_summary(...) of this assignment


def balanced_phase(head_map: HeadMap, phase: str) -> str:
    """``phase``, or for ``auto``: decode when entries hold less than everything (budgets,
    streaming heads), prefill when any entry has another pattern, else decode."""
    if phase != "auto":
        return phase
    if any(e.budget is not None or e.pattern.startswith("streaming") for e in head_map.entries):
        return "decode"
    return "prefill" if any(e.pattern != "full" for e in head_map.entries) else "decode"


def with_ranks(head_map: HeadMap, assignments: list[LayerAssignment]) -> HeadMap:
    """``head_map`` whose entries name the ranks of their copies and the copies' shares."""
    entries = []
    for entry in head_map.entries:
        copies = assignments[entry.layer][entry.kv_head]
        shares = tuple(s for _, s in copies) if len(copies) > 1 else ()
        entries.append(replace(entry, rank=tuple(r for r, _ in copies), shares=shares))
    return HeadMap(head_map.num_layers, head_map.num_kv_heads, entries)


def priced_map(head_map: HeadMap, per_head_pages: bool, budget_tokens: int | None,
               shares: list[list[float]] | None = None) -> HeadMap:  # fmt: skip
    """The map the solvers price, the engine's under torchrun and ``headspace plan``'s alike:
    ``head_map`` (its patterns) and, with per-entry pages, each entry's budget (a ring its
    sink and window), budgeted entries scaled by a profile's measured ``shares``."""
    if not per_head_pages:
        return head_map
    head_map = with_budgets(head_map, budget_tokens)
    if shares and budget_tokens is not None:
        head_map = with_budget_shares(head_map, shares)
    return head_map


BALANCE_CHUNK = 8192  # the prefill chunk priced where none is set


def balance_heads(head_map: HeadMap, shape: CostShape, config: ParallelConfig, *,
                  context: int, chunk: int | None = None, batch: int = 1,
                  hw: Hardware | None = None,
                  profile: Profile | None = None) -> Balance:  # fmt: skip
    """Assign every (layer, kv head) of ``head_map`` to ``config.gpus`` ranks by its solver,
    balancing the costs of one step of the chosen phase at ``context`` tokens (prefill in
    chunks of ``chunk``, default :data:`BALANCE_CHUNK`)."""
    chunk = chunk or BALANCE_CHUNK
    costs: dict[str, list[list[HeadCost]]] = {
        phase: head_costs(head_map, shape, hw, phase=phase, context=context, chunk=chunk,
                          batch=batch, profile=profile)
        for phase in ("prefill", "decode")
    }  # fmt: skip
    phase = balanced_phase(head_map, config.balance_phase)
    assignments = solve_layers(config.balance, costs[phase], config.gpus,
                               replicas=config.replicas, seed=config.seed)  # fmt: skip
    loads = {name: balance_summary(c, assignments, config.gpus) for name, c in costs.items()}
    return Balance(with_ranks(head_map, assignments), phase, assignments, loads)

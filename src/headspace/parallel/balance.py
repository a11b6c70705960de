"""A head map's ranks from its heads' costs: the chosen solver layer by layer, and the loads
it leaves (what ``headspace plan --gpus N`` prints and the engine follows)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from headspace.errors import UserError
from headspace.parallel.assignment import LayerAssignment, LayerCosts, balance_summary
from headspace.parallel.config import ParallelConfig
from headspace.parallel.solvers import check_limits, solve_layers
from headspace.planner.head_cost import PHASES, CostShape, HeadCost, head_costs
from headspace.planner.head_map import HeadMap
from headspace.planner.memory import Hardware
from headspace.planner.profile import Profile, with_budget_shares
from headspace.planner.sparsity import with_budgets


@dataclass(frozen=True)
class Balance:
    """A solved assignment: the head map with ranks, and its loads per phase."""

    head_map: HeadMap
    phase: str  # the phases whose costs were balanced ("prefill+decode": both at once)
    assignments: list[LayerAssignment]
    loads: dict[str, dict]  # phase -> balance_summary(...) of this assignment


def balanced_phases(phase: str) -> tuple[str, ...]:
    """The phases whose costs the solvers balance: ``phase``, or for ``auto`` both (a
    patterned head is light at prefill, a budgeted one at decode, and balancing one phase
    alone can leave the other uneven: Ada-SnapKV's heads all cost alike at prefill)."""
    return PHASES if phase == "auto" else (phase,)


def layer_costs(costs: dict[str, list[list[HeadCost]]], phases: tuple[str, ...]) -> list:
    """Per layer, the costs the solvers see: one phase's ``HeadCost`` list, or the phases'
    ``LayerCosts`` with each phase weighed by one over its total seconds over the model (each
    phase's imbalance counts alike, whatever its length)."""
    if len(phases) == 1:
        return costs[phases[0]]
    totals = [sum(c.total for row in costs[p] for c in row) for p in phases]
    weights = tuple(1 / t if t > 0 else 0.0 for t in totals)
    weights = weights if any(weights) else (1.0,) * len(phases)
    return [LayerCosts(tuple(tuple(costs[p][layer]) for p in phases), weights)
            for layer in range(len(costs[phases[0]]))]  # fmt: skip


def priced_hardware(config: ParallelConfig, hw: Hardware | None = None) -> Hardware | None:
    """The rates the solvers price with: ``hw``, with ``config.copy_seconds`` where set as
    the whole of what a copy adds, whatever the batch (its merge, its work per sequence and
    the kernel rows it repeats)."""
    if config.copy_seconds is None:
        return hw
    return replace(hw or Hardware(), copy_seconds=config.copy_seconds, copy_row_seconds=0.0,
                   decode_row_seconds=0.0)  # fmt: skip


def assignments_of(head_map: HeadMap) -> list[LayerAssignment]:
    """Each layer's assignment that a ranked ``head_map`` holds (:func:`with_ranks`' inverse)."""
    return [tuple(tuple(zip(e.rank, e.shares or (1.0,), strict=True)) for e in head_map.layer(i))
            for i in range(head_map.num_layers)]  # fmt: skip


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


def check_balance(config: ParallelConfig, num_kv_heads: int) -> None:
    """UserError where ``config.balance`` cannot search layers of ``num_kv_heads`` over
    ``config.gpus`` ranks. Under torchrun every rank checks before rank 0 solves, so none
    waits for a rank that refused."""
    try:
        check_limits(config.balance, num_kv_heads, config.gpus, config.replicas)
    except ValueError as exc:
        raise UserError(
            f"balance {config.balance} over {config.gpus} GPUs: {exc}; choose "
            "another solver (fairkv, greedy)"
        ) from None


def balance_heads(head_map: HeadMap, shape: CostShape, config: ParallelConfig, *,
                  context: int, chunk: int | None = None, batch: int = 1,
                  hw: Hardware | None = None,
                  profile: Profile | None = None) -> Balance:  # fmt: skip
    """Assign every (layer, kv head) of ``head_map`` to ``config.gpus`` ranks by its solver,
    balancing the costs of one step of the chosen phase, or of both (``auto``), at
    ``context`` tokens (prefill in chunks of ``chunk``, default :data:`BALANCE_CHUNK`)."""
    chunk = chunk or BALANCE_CHUNK
    hw = priced_hardware(config, hw)
    costs: dict[str, list[list[HeadCost]]] = {
        phase: head_costs(head_map, shape, hw, phase=phase, context=context, chunk=chunk,
                          batch=batch, profile=profile)
        for phase in PHASES
    }  # fmt: skip
    phases = balanced_phases(config.balance_phase)
    assignments = solve_layers(config.balance, layer_costs(costs, phases), config.gpus,
                               replicas=config.replicas, seed=config.seed)  # fmt: skip
    loads = {name: balance_summary(c, assignments, config.gpus) for name, c in costs.items()}
    return Balance(with_ranks(head_map, assignments), "+".join(phases), assignments, loads)

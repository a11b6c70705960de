"""One rank's plan under head parallelism, and the whole map it makes: pure arithmetic, the
same on every rank (the engine under torchrun) and in ``headspace plan --gpus N``.

The engine plans the widest rank's part (:class:`~headspace.planner.context.RankShape`:
its weights, pages as wide as the widest rank's layer, the smallest arena) and spreads that
plan over every rank's heads (:func:`spread_plan`); with per-entry pages the entry planner
places every rank's entries alike (:func:`entry_parts`).
"""

from __future__ import annotations

from dataclasses import replace

from headspace.errors import UserError
from headspace.model.config import ModelConfig
from headspace.parallel.placement import RankLayout, rank_layout
from headspace.planner.context import PlanRequest, RankShape, make_plan
from headspace.planner.head_map import HeadMap
from headspace.planner.plan import Plan
from headspace.planner.sparsity import held_tokens


def entry_parts(layouts: tuple[RankLayout, ...]) -> tuple:
    """Every rank's per-entry pages as the entry planner's parts, planned alike: (its
    entries, [layer] its own kv heads, which may go to host pages; copies stay resident)."""
    return tuple((sum(lay.layer_heads), tuple(lay.own)) for lay in layouts)


def page_heads(head_map: HeadMap, world: int) -> int:
    """The most kv heads any of ``world`` ranks holds in one layer (copies included): the
    width of every rank's pages, and what its weights are sized for."""
    return max(rank_layout(head_map, rank, world).most_heads for rank in range(world))


def own_resident(layout: RankLayout, sized: HeadMap, what: str) -> list[int]:
    """``[layer]`` how many of ``layout``'s own heads stay resident when its pages hold as
    many entries as ``sized``'s resident ones: in each layer the places the plan leaves
    resident after its copies, less where copies overflow a layer's places (from the
    layers keeping the most, the last first), more where places are left over (the first
    layers first). UserError where the copies alone overflow the pages."""
    copies = [len(c) for c in layout.copies]
    room = sized.count("gpu") - sum(copies)
    if room < 0:
        raise UserError(
            f"{what} streams KV from host memory, and the copies of heads rank {layout.rank} "
            f"keeps on its GPU ({sum(copies)} entries) leave no room for its own in the plan's "
            f"{sized.count('gpu')} resident entries; pass --replicas 0 (no copies) or raise "
            f"the GPU budget"
        )  # fmt: skip
    places = [len(sized.heads(layer, "gpu")) for layer in range(sized.num_layers)]
    kept = [
        max(0, min(len(own), n - c)) for own, n, c in zip(layout.own, places, copies, strict=True)
    ]
    for _ in range(sum(kept) - room):
        most = max(reversed(range(len(kept))), key=kept.__getitem__)
        kept[most] -= 1
    spare = room - sum(kept)  # places other ranks' wider layers use: this rank's to fill
    for layer, own in enumerate(layout.own):
        extra = min(spare, len(own) - kept[layer])
        kept[layer], spare = kept[layer] + extra, spare - extra
    return kept


def spread_plan(plan: Plan, head_map: HeadMap, layouts: tuple[RankLayout, ...],
                what: str) -> Plan:  # fmt: skip
    """The planner's ``plan`` for a rank as wide as the widest (the same on every rank) as
    the whole ``head_map``: each rank keeps as many entries resident as the plan's pages
    hold (its copies first, always resident), and its own heads past them in each layer
    stream in groups of the plan's size (a group id per rank). The plan's ``rank_map``
    keeps what was sized."""
    if plan.staging is None:
        return replace(plan, head_map=head_map)
    sized, width = plan.head_map, head_map.num_kv_heads
    tier = "hybrid" if plan.offload == "hybrid" else "stream"
    entries = list(head_map.entries)
    for lay in layouts:
        for layer, num_resident in enumerate(own_resident(lay, sized, what)):
            for index, head in enumerate(lay.own[layer][num_resident:]):
                group = lay.rank * width + index // plan.staging.group
                at = layer * width + head
                entries[at] = replace(entries[at], tier=tier, group=group)
    return replace(plan, head_map=HeadMap(head_map.num_layers, width, entries), rank_map=sized)


def rank_kv(head_map: HeadMap, world: int, context: int,
            tier: str | None = "gpu") -> list[tuple[int, int]]:  # fmt: skip
    """``[rank]`` (entries, entry-tokens held after a ``context``-token prompt) of the
    entries in ``tier`` (None: every tier) each rank holds; a copy holds its head's whole
    KV on every rank (each computes its keys and values for every token)."""
    held = [[0, 0] for _ in range(world)]
    for entry in head_map.entries:
        if tier is not None and entry.tier != tier:
            continue
        tokens = held_tokens(entry.pattern, entry.budget, context)
        for rank in entry.rank:
            held[rank][0] += 1
            held[rank][1] += tokens
    return [(num, tokens) for num, tokens in held]


def plan_for_ranks(config: ModelConfig, request: PlanRequest, head_map: HeadMap,
                   world: int) -> Plan:  # fmt: skip
    """``make_plan`` for the widest of ``world`` ranks of the balanced ``head_map``, as the
    engine plans it under torchrun, over the whole map (every entry's tier and ranks). The
    memory table is that rank's: its weights and pool, and the most KV one rank keeps on
    its GPU (``gpu_kv``, ``kv_held``)."""
    layouts = tuple(rank_layout(head_map, rank, world) for rank in range(world))
    widest = max(lay.most_heads for lay in layouts)
    shape = RankShape(world, widest, head_map, entry_parts(layouts))
    plan = make_plan(config, replace(request, ranks=shape))
    if not request.per_head_pages:
        plan = spread_plan(plan, head_map, layouts, f"a context of {request.context} tokens")
    per_token = 2 * config.head_dim * request.dtype_bytes
    held = rank_kv(plan.head_map, world, request.context)
    pages = -(-request.context // request.page_size) * request.page_size
    plan.memory["gpu_kv"] = max(num for num, _ in held) * pages * per_token
    plan.memory["kv_held"] = max(tokens for _, tokens in held) * per_token
    return plan

"""Head parallelism under ``torchrun``: join the process group, balance the kv heads over the
ranks by the chosen solver (the head map's ``rank`` field), and shard the loaded model so
each rank keeps its heads' weights and a slice of the MLP, its partial outputs summed by an
all-reduce. Every rank runs the same engine over its own heads; the scheduler's decisions
are the same on every rank (the same pages, the same plan, the same prompts, sampled tokens
from rank 0). Where the plan offloads, each rank fills its pages with its own entries and
streams the rest of its heads from its host pages (:meth:`Ranks.spread`); with per-entry
pages (budgets, streaming heads) the entry planner places every rank's entries alike, each
rank's own heads past its pages in its host pages (:meth:`Ranks.entry_parts`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from headspace.budgets import KVBudget
from headspace.errors import UserError
from headspace.model.llama import LlamaModel
from headspace.parallel.balance import balance_heads
from headspace.parallel.dist import (
    all_reduce_sum,
    broadcast_object,
    host_min,
    init_from_env,
    local_world_size,
)
from headspace.parallel.placement import RankLayout, rank_layout
from headspace.parallel.shard import shard_layer, shard_model
from headspace.planner.head_cost import CostShape
from headspace.planner.head_map import HeadMap
from headspace.planner.memory import KVSpec
from headspace.planner.plan import Plan
from headspace.planner.profile import Profile, budget_key, with_budget_shares, with_patterns
from headspace.planner.sparsity import with_budgets


@dataclass(frozen=True)
class Ranks:
    """This rank's part of a head-parallel engine."""

    rank: int
    layouts: tuple[RankLayout, ...]  # every rank's heads
    head_map: HeadMap  # every entry, with its ranks and shares

    @property
    def layout(self) -> RankLayout:
        return self.layouts[self.rank]

    @property
    def most_heads(self) -> int:
        """The most kv heads any rank holds in one layer (its pages' width)."""
        return max(lay.most_heads for lay in self.layouts)

    def pages(self, spec: KVSpec, arena: int) -> tuple[KVSpec, int]:
        """The planner's page shape and arena, the same on every rank (so every scheduler
        makes the same choices): pages as wide as the widest rank's layer, and the smallest
        rank's arena."""
        return replace(spec, num_kv_heads=self.most_heads), host_min(arena)

    def host_bytes(self, budget: int) -> int:
        """This rank's share of the host's KV budget, the same on every rank: the ranks
        on one machine (``LOCAL_WORLD_SIZE``) divide its memory."""
        return host_min(budget // local_world_size())

    def keep_heads(self, index: int, layer) -> None:
        """Shard decoder layer ``index`` for this rank: its heads' weights (own, then copies)
        and its slice of the MLP, the partial outputs summed by an all-reduce."""
        layout = self.layout
        shard_layer(layer, layout.heads(index), layout.rank, layout.world, all_reduce_sum)

    def entry_parts(self) -> list[tuple[int, list[list[int]]]]:
        """Every rank's per-entry pages as the entry planner's parts, planned alike: (its
        entries, [layer] its own kv heads, which may go to host pages; copies stay
        resident)."""
        return [(sum(lay.layer_heads), [list(own) for own in lay.own]) for lay in self.layouts]

    def entry_counts(self, head_map: HeadMap) -> list[tuple[int, int]]:
        """``[rank]`` (resident, offloaded) entries of each rank under ``head_map``."""
        counts = []
        for lay in self.layouts:
            offloaded = sum(head_map.entry(layer, h).tier != "gpu"
                            for layer, own in enumerate(lay.own) for h in own)  # fmt: skip
            counts.append((sum(lay.layer_heads) - offloaded, offloaded))
        return counts

    def spread(self, plan: Plan, what: str) -> Plan:
        """The planner's ``plan`` for a rank as wide as the widest (the same on every rank)
        as the whole map: each rank keeps as many entries resident as the plan's pages
        hold (its copies first, always resident), and its own heads past them in each layer
        stream in groups of the plan's size (a group id per rank). The plan's ``rank_map``
        keeps what was sized."""
        if plan.staging is None:
            return replace(plan, head_map=self.head_map)
        sized, width = plan.head_map, self.head_map.num_kv_heads
        tier = "hybrid" if plan.offload == "hybrid" else "stream"
        entries = list(self.head_map.entries)
        for lay in self.layouts:
            for layer, num_resident in enumerate(own_resident(lay, sized, what)):
                for index, head in enumerate(lay.own[layer][num_resident:]):
                    group = lay.rank * width + index // plan.staging.group
                    at = layer * width + head
                    entries[at] = replace(entries[at], tier=tier, group=group)
        head_map = HeadMap(self.head_map.num_layers, width, entries)
        return replace(plan, head_map=head_map, rank_map=sized)


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


def join(config):
    """Under torchrun: join the process group and give a plain ``cuda`` device this rank's
    GPU (``LOCAL_RANK``); returns the config to build the engine with. A named GPU stays
    under a gloo group made beforehand (ranks sharing one GPU, as tests do)."""
    _, world = init_from_env(config.device)
    if world == 1 or not config.on_gpu:
        return config
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    if config.device != "cuda" and dist.get_backend() != "nccl":  # gloo ranks may share one
        return config
    if config.device not in ("cuda", device):
        raise UserError(f"under torchrun each rank uses the GPU of its LOCAL_RANK ({device}): "
                        f"pass --device cuda, not {config.device}")  # fmt: skip
    torch.cuda.set_device(device)  # also where the process group was made elsewhere
    return replace(config, device=device)


def costed_map(cfg, config, profile: Profile | None, max_context: int) -> HeadMap:
    """The head map whose costs the solver balances: the profile's patterns, and with
    per-entry pages what each entry keeps at ``max_context`` tokens (budgeted entries by the
    profile's measured shares of the policy, where it has them)."""
    head_map = HeadMap.all_gpu(cfg.num_layers, cfg.num_kv_heads)
    if config.retrieval_heads is not None:
        head_map = with_patterns(head_map, profile.retrieval, config.retrieval_heads,
                                 config.sparse_pattern)  # fmt: skip
    if not config.per_head_pages:
        return head_map
    if config.kv_budget is None:
        return with_budgets(head_map, None)  # rings keep their sink and window
    budget = KVBudget(config.kv_budget, config.kv_policy, pool=config.kv_pool)
    head_map = with_budgets(head_map, budget.tokens(max_context))
    shares = profile and profile.budget_shares.get(budget_key(budget.policy, budget.value))
    return with_budget_shares(head_map, shares) if shares else head_map


def plan_ranks(cfg, config, profile: Profile | None, max_context: int) -> Ranks | None:
    """Under torchrun with several ranks: the balanced head map (solved on rank 0 on the
    model config ``cfg``'s costs, the same everywhere) and this rank's part of it; None in
    one process."""
    rank, world = init_from_env(config.device)
    if world == 1:
        return None
    head_map = costed_map(cfg, config, profile, max_context)
    if rank == 0:
        parallel = replace(config.parallel, gpus=world)
        shape = CostShape.of(cfg, config.torch_dtype.itemsize)
        head_map = balance_heads(
            head_map,
            shape,
            parallel,
            context=max_context,
            chunk=config.prefill_chunk or 8192,
            profile=profile,
        ).head_map
    head_map = broadcast_object(head_map)
    layouts = tuple(rank_layout(head_map, r, world) for r in range(world))
    return Ranks(rank, layouts, head_map)


def setup_ranks(model: LlamaModel, config, profile: Profile | None,
                max_context: int) -> Ranks | None:  # fmt: skip
    """:func:`plan_ranks` for a model already in memory (e.g. random weights), sharded in
    place for this rank."""
    ranks = plan_ranks(model.config, config, profile, max_context)
    if ranks is not None:
        layout = ranks.layout
        shard_model(model, ranks.head_map, layout.rank, layout.world, all_reduce_sum,
                    heads=[layout.heads(index) for index in range(layout.num_layers)])  # fmt: skip
        if config.on_gpu:
            torch.cuda.empty_cache()  # the other ranks' weights, freed
    return ranks

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

from headspace.errors import UserError
from headspace.kv.spec import KVSpec
from headspace.model.llama import LlamaModel
from headspace.parallel.balance import balance_heads, check_balance, priced_map
from headspace.parallel.dist import all_reduce_sum, broadcast_object, host_min, init_from_env
from headspace.parallel.launch import local_world_size
from headspace.parallel.placement import RankLayout, rank_layout
from headspace.parallel.rank_plan import entry_parts, spread_plan
from headspace.parallel.shard import shard_layer, shard_model
from headspace.planner.head_cost import CostShape
from headspace.planner.head_map import HeadMap
from headspace.planner.plan import Plan
from headspace.planner.profile import Profile, budget_key


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

    @property
    def on_host(self) -> int:
        """Ranks on this machine (``LOCAL_WORLD_SIZE``): they divide its host memory."""
        return local_world_size()

    def keep_heads(self, index: int, layer) -> None:
        """Shard decoder layer ``index`` for this rank: its heads' weights (own, then copies)
        and its slice of the MLP, the partial outputs summed by an all-reduce."""
        layout = self.layout
        shard_layer(layer, layout.heads(index), layout.rank, layout.world, all_reduce_sum)

    def entry_parts(self) -> tuple:
        """Every rank's per-entry pages as the entry planner's parts (:func:`entry_parts`)."""
        return entry_parts(self.layouts)

    def entry_counts(self, head_map: HeadMap) -> list[tuple[int, int]]:
        """``[rank]`` (resident, offloaded) entries of each rank under ``head_map``."""
        counts = []
        for lay in self.layouts:
            offloaded = sum(head_map.entry(layer, h).tier != "gpu"
                            for layer, own in enumerate(lay.own) for h in own)  # fmt: skip
            counts.append((sum(lay.layer_heads) - offloaded, offloaded))
        return counts

    def spread(self, plan: Plan, what: str) -> Plan:
        """The widest rank's ``plan`` as the whole map (:func:`spread_plan`)."""
        return spread_plan(plan, self.head_map, self.layouts, what)


def join(config):
    """Under torchrun: join the process group and give a plain ``cuda`` device this rank's
    GPU (``LOCAL_RANK``); returns the config to build the engine with. A named GPU stays
    under a gloo group made beforehand (ranks sharing one GPU, as tests do)."""
    _, world = init_from_env(config.runtime.device)
    if world == 1 or not config.runtime.on_gpu:
        return config
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    if config.runtime.device != "cuda" and dist.get_backend() != "nccl":  # gloo ranks may share one
        return config
    if config.runtime.device not in ("cuda", device):
        raise UserError(f"under torchrun each rank uses the GPU of its LOCAL_RANK ({device}): "
                        f"pass --device cuda, not {config.runtime.device}")  # fmt: skip
    torch.cuda.set_device(device)  # also where the process group was made elsewhere
    return config.on(device)


def costed_map(cfg, config, profile: Profile | None, max_context: int) -> HeadMap:
    """The head map whose costs the solver balances: the profile's patterns, and with
    per-entry pages what each entry keeps at ``max_context`` tokens (budgeted entries by the
    profile's measured shares of the policy, where it has them)."""
    head_map = HeadMap.all_gpu(cfg.num_layers, cfg.num_kv_heads)
    head_map = config.with_patterns(head_map, profile.retrieval if profile else None)
    tokens, shares, budget = None, None, config.entry_budget()
    if budget is not None:
        tokens = budget.tokens(max_context)
        shares = profile and profile.budget_shares.get(budget_key(budget.policy, budget.value))
    entry_pages = config.entries_per_page(KVSpec.of(cfg, 1, 1)) is not None
    return priced_map(head_map, entry_pages, tokens, shares)


def balanced_map(head_map: HeadMap, cfg, config, profile: Profile | None, max_context: int,
                 world: int) -> HeadMap:  # fmt: skip
    """``head_map`` (a :func:`costed_map`) balanced over ``world`` ranks by the configured
    solver, each phase priced at ``max_context`` tokens, decode at ``balance_batch``
    sequences."""
    parallel = replace(config.parallel, gpus=world)
    shape = CostShape.of(cfg, config.runtime.torch_dtype.itemsize)
    return balance_heads(head_map, shape, parallel, context=max_context,
                         chunk=config.runtime.prefill_chunk, batch=parallel.balance_batch,
                         profile=profile).head_map  # fmt: skip


def plan_ranks(cfg, config, profile: Profile | None, max_context: int) -> Ranks | None:
    """Under torchrun with several ranks: the balanced head map (solved on rank 0 on the
    model config ``cfg``'s costs, the same everywhere) and this rank's part of it; None in
    one process."""
    rank, world = init_from_env(config.runtime.device)
    if world == 1:
        return None
    # every rank refuses alike, before rank 0 solves
    check_balance(replace(config.parallel, gpus=world), cfg.num_kv_heads)
    head_map = costed_map(cfg, config, profile, max_context)
    if rank == 0:
        head_map = balanced_map(head_map, cfg, config, profile, max_context, world)
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
        if config.runtime.on_gpu:
            torch.cuda.empty_cache()  # the other ranks' weights, freed
    return ranks

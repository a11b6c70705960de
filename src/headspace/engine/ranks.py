"""Head parallelism under ``torchrun``: join the process group, balance the kv heads over the
ranks by the chosen solver (the head map's ``rank`` field), and shard the loaded model so
each rank keeps its heads' weights and a slice of the MLP, its partial outputs summed by an
all-reduce. Every rank runs the same engine over its own heads; the scheduler's decisions
are the same on every rank (the same pages, the same prompts, sampled tokens from rank 0).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from headspace.errors import UserError
from headspace.model.llama import LlamaModel
from headspace.parallel.balance import balance_heads
from headspace.parallel.dist import (
    all_reduce_min,
    all_reduce_sum,
    broadcast_object,
    init_from_env,
)
from headspace.parallel.placement import RankLayout, rank_layout
from headspace.parallel.shard import shard_model
from headspace.planner.head_cost import CostShape
from headspace.planner.head_map import HeadMap
from headspace.planner.memory import KVSpec
from headspace.planner.plan import Plan, plan_batch
from headspace.planner.profile import Profile, with_patterns


@dataclass(frozen=True)
class Ranks:
    """This rank's part of a head-parallel engine."""

    layout: RankLayout
    head_map: HeadMap  # every entry, with its ranks and shares
    most_heads: int  # the most kv heads any rank holds in one layer (its pages' width)

    def pages(self, spec: KVSpec, arena: int, device: str) -> tuple[KVSpec, int]:
        """The planner's page shape and arena, the same on every rank (so every scheduler
        makes the same choices): pages as wide as the widest rank's layer, and the smallest
        rank's arena."""
        return replace(spec, num_kv_heads=self.most_heads), all_reduce_min(arena, device)

    def plan(self, spec: KVSpec, arena: int, num_pages: int, what: str) -> Plan:
        """Every rank's heads resident (no offload yet under torchrun); the plan's head map
        is the whole map, with the ranks and the patterns."""
        plan = plan_batch(spec, arena, num_pages, offload="none", what=what)
        plan.head_map = self.head_map
        return plan


def join(config):
    """Under torchrun: join the process group and give a plain ``cuda`` device this rank's
    GPU (``LOCAL_RANK``); returns the config to build the engine with."""
    _, world = init_from_env(config.device)
    if world == 1 or not config.on_gpu:
        return config
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    if config.device not in ("cuda", device):
        raise UserError(f"under torchrun each rank uses the GPU of its LOCAL_RANK ({device}): "
                        f"pass --device cuda, not {config.device}")  # fmt: skip
    torch.cuda.set_device(device)  # also where the process group was made elsewhere
    return replace(config, device=device)


def _check(config) -> None:
    if config.per_head_pages:
        raise UserError("under torchrun, KV budgets and streaming heads are not supported yet: "
                        "drop kv_budget, or use a prefill pattern (vertical_slash, "
                        "block_sparse) as sparse_pattern")  # fmt: skip
    if config.offload not in ("auto", "none"):
        raise UserError(f"under torchrun every rank keeps its heads' KV on its GPU: offload "
                        f"must be auto or none, got {config.offload!r}")  # fmt: skip


def setup_ranks(model: LlamaModel, config, profile: Profile | None,
                max_context: int) -> Ranks | None:  # fmt: skip
    """Under torchrun with several ranks: the balanced head map (solved on rank 0, the same
    everywhere) and ``model`` sharded in place for this rank; None in one process."""
    rank, world = init_from_env(config.device)
    if world == 1:
        return None
    _check(config)
    cfg = model.config
    head_map = HeadMap.all_gpu(cfg.num_layers, cfg.num_kv_heads)
    if config.retrieval_heads is not None:
        head_map = with_patterns(head_map, profile.retrieval, config.retrieval_heads,
                                 config.sparse_pattern)  # fmt: skip
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
    layouts = [rank_layout(head_map, r, world) for r in range(world)]
    layout = layouts[rank]
    heads = [layout.heads(layer) for layer in range(cfg.num_layers)]
    shard_model(model, head_map, rank, world, all_reduce_sum, heads=heads)
    if config.on_gpu:
        torch.cuda.empty_cache()  # the other ranks' weights, freed
    return Ranks(layout, head_map, max(lay.most_heads for lay in layouts))

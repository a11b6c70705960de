"""Runs the model over the tiers of the current plan: per-sequence chunked prefill, batched
decode, swapping sequences between the GPU pool and host pages.

The runner holds the KV arena (GPU), the host pages and the tiers of the current plan
(``tiers.table`` builds them); the block tables are the scheduler's, and each step names
the pages it runs over (``StepPlan``). ``apply(plan)`` lays the arena out for a new head map
(only when no sequence holds GPU pages) and says how the page pools follow; the all-resident
layout is always the same tensors, so its CUDA graphs survive a detour through streaming.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from headspace.engine.config import EngineConfig
from headspace.engine.hooks import EngineHooks
from headspace.engine.hybrid_share import HybridShare
from headspace.engine.runner_graphs import GraphCache, RunnerGraphs
from headspace.engine.runner_prefill import PrefillSteps
from headspace.engine.step_plan import LayoutResult, Resize, StepPlan
from headspace.errors import HostPagesRefused, UserError
from headspace.kv.block_table import BlockManager, Pages, PoolLayout
from headspace.kv.host_store import HostKVArena
from headspace.kv.paged_store import KVArena, PagedKVStore
from headspace.kv.spec import KVSpec
from headspace.kv.transfer import device_ints, swap_pages
from headspace.model.llama import LlamaModel
from headspace.parallel.dist import first_error, host_min, release_before_leaving
from headspace.parallel.placement import RankLayout
from headspace.planner.plan import Plan
from headspace.planner.profile import Profile
from headspace.tiers import StepInputs, Tier, TierSite, build_tiers
from headspace.tiers.base import MIN_WIDTH, block_table, bucket
from headspace.tiers.layout import (
    head_ranges,
    host_places,
    layout_key,
    prefill_rings,
    staging_slots,
    window_slots,
)

DecodeResult = tuple[torch.Tensor, torch.Tensor]  # fp32 logits [seqs, vocab], slots [seqs]


@dataclass
class RunnerParts:
    """What a lane's runner runs over: its page shape (``spec``), its part of the KV arena
    (``store``, within ``arena``), its host pages, the lane's block tables (which the tiers
    under budgets keep per-entry lengths in), ``max_slots`` token slots, ``max_context``,
    the engine's ``profile`` (checked against the model) and one rank's heads under
    torch.distributed (``layout``; None: all heads)."""

    spec: KVSpec
    arena: KVArena
    store: PagedKVStore
    host: HostKVArena
    blocks: BlockManager
    max_slots: int
    max_context: int
    profile: Profile | None = None
    layout: RankLayout | None = None


class PagedRunner(PrefillSteps, RunnerGraphs):
    """Steps the model for sequences whose K/V live in the lane's part of the GPU arena and
    in host pages. Its layout changes only through :meth:`prepare` (a step plan's layout,
    resize, host pages and page copies); :meth:`decode` and :meth:`prefill_chunk` run the
    model over the layout in force."""

    def __init__(self, model: LlamaModel, config: EngineConfig, parts: RunnerParts,
                 hooks: EngineHooks | None = None):  # fmt: skip
        hooks = hooks or EngineHooks()
        layout = parts.layout
        if layout is not None and config.runtime.attention_backend == "flex":
            raise UserError("attention_backend flex does not run over several GPUs yet (copied "
                            "heads decode through their own kernels); use sdpa")  # fmt: skip
        self.model, self.config, self.spec, self.host = model, config, parts.spec, parts.host
        self.arena, self.store = parts.arena, parts.store
        self.graphs_class, self.prompt_stand_in = hooks.graphs, hooks.prompt_stand_in
        # each layer's attention calls this when set: ``hook(layer, q, kv) -> out`` (a
        # benchmark's timer; ``attend_tiers(runner.tiers, ...)`` is the tiers' own)
        self.attention_hook = hooks.attention_hook
        # each decode step runs as ``hook(seq_ids, step) -> step()``'s result, the first hook
        # innermost (benchmarks' timers, profilers and traces; none by default)
        self.decode_hooks: list[Callable[[list[int], Callable[[], DecodeResult]],
                                         DecodeResult]] = hooks.decode_hooks  # fmt: skip
        self.layout = layout  # one rank's heads under torch.distributed (None: all heads)
        self.max_context = parts.max_context
        self.device = torch.device(config.runtime.device)
        self.budget = config.entry_budget()
        self.profile = parts.profile  # the engine's, checked against the model
        # the last sampled token of each running sequence (+1 scratch slot for graph padding)
        self.tokens = torch.zeros(parts.max_slots + 1, dtype=torch.long, device=self.device)
        self._compiled = config.runtime.compile and self.device.type == "cuda"
        self.plan: Plan | None = None
        profile = parts.profile
        self.site = TierSite(
            self.store, parts.host, parts.blocks, self.spec, model.config.num_queries_per_kv,
            config.runtime.attention_backend, max_slots=self.tokens.numel(),
            per_entry_pages=parts.blocks.per_entry, layout=layout, budget=self.budget,
            head_scores=None if profile is None else torch.tensor(profile.retrieval),
            hybrid=config.hybrid_settings(),
            prefix_piece=hooks.prefix_piece, key_span=config.runtime.prefill_key_span,
            cpu_timings=hooks.cpu_timings,
        )  # fmt: skip
        self.tiers: list[Tier] = []  # the current plan's (tiers.table)
        self._cpu_spared = 0  # CPU cores the hybrid tier's attention leaves (spare_cpu_cores)
        self.hybrid_share = HybridShare(hooks.step_clock)  # the hybrid tier's CPU share
        self._layout: tuple | None = None
        self._layout_ids: dict[tuple, int] = {}  # a small key per layout seen, for the graphs
        self.graph_cache = GraphCache(hooks.graphs is not None)
        if layout is not None:  # its graphs capture collectives: they go before the group
            release_before_leaving(self.release_graphs)

    # -- what a step plan changes --------------------------------------------------------
    def prepare(self, step: StepPlan) -> LayoutResult | None:
        """Make the changes ``step`` plans before its compute, in order: a new layout (such a
        step carries nothing else; returns what it made, for the scheduler), or the
        resident pool's resize; the host pages grown (HostPagesRefused, the resize made,
        when they cannot be); page copies in, then out."""
        if step.layout is not None:
            return self._lay_out_plan(step.layout, step.host_pages, step.host_kept)
        if step.resize is not None:
            self._resize(step.resize)
        if step.host_pages > self.host.num_pages:
            try:
                self._grow_host(step.host_pages, keep=True)
            except UserError as error:  # (on every rank alike)
                raise self._refused(f"no host pages for a swapped-out sequence or a prompt "
                                    f"({step.host_pages} pages): {error}") from None  # fmt: skip
        self._swap(step.swap_in, to_host=False)
        self._swap(step.swap_out, to_host=True)
        return None

    def rebind(self, part: torch.Tensor) -> None:
        """Take ``part`` of the arena as this lane's from now on (an offload lane whose part
        moved, holding no pages): the next layout is laid over it."""
        self.release_graphs()
        self.store.rebind(part)
        self.plan, self._layout, self.tiers = None, None, []

    def _lay_out_plan(self, plan: Plan, host_pages: int, keep: bool) -> LayoutResult:
        """The host arena for ``plan`` (its rows, when per-entry pages change them), then the
        layout and its tiers."""
        rows = plan.host_rows or None
        reset = rows is not None and rows != self.host.rows  # nothing in host pages
        try:
            if reset:
                host_pages = self._grow_host(host_pages, keep=False, rows=rows)
            elif host_pages > self.host.num_pages:
                host_pages = self._grow_host(host_pages, keep=keep)
            else:
                host_pages = self._host_pages()
        except UserError as error:  # (on every rank alike)
            raise self._refused(str(error)) from None
        pools = self._apply(plan)
        return LayoutResult(pools, self.layer_slices, host_pages, reset, self.mixes)

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    @property
    def streaming(self) -> bool:
        return self.plan is not None and self.plan.head_map.num_offloaded > 0

    def _apply(self, plan: Plan) -> PoolLayout | None:
        """Lay the arena out for ``plan`` and build its tiers (no sequence may hold GPU
        pages; the host arena already holds ``plan.num_host_pages``). Returns how the page pools
        are reset for it, or None when the layout stays."""
        key = layout_key(plan)
        if key == self._layout:  # the same tensors; the map's budgets may be this batch's
            self.plan.head_map = plan.head_map
            return None
        pools = self._lay_out(plan, key)
        self.tiers = build_tiers(plan, self.site)
        # searched unless asked for; not under torchrun, where each rank would time its own
        # steps and could settle apart (the ranks keep the plan's share)
        searched = self.config.searches_share and self.layout is None
        self.hybrid_share.apply(plan, self.tiers, searched)
        return pools

    @property
    def cpu_share(self) -> float | None:
        """The hybrid tier's CPU share (:attr:`HybridShare.share`); None without the tier."""
        return self.hybrid_share.share

    def _lay_out(self, plan: Plan, key: tuple) -> PoolLayout:
        """The arena's layers for ``plan`` (layout ``key``) and how its page pools follow.
        Shared pages: per layer the resident heads (this rank's own), then under torchrun
        its copies (arena layers ``L..2L-1``), and staging slots; the host prefix cache
        survives a map that stays. Per-entry pages: one plane; the offloaded entries' pages
        are host pages."""
        spec, layout, site = self.spec, self.layout, self.site
        if site.per_entry_pages:  # entries numbered layer by layer
            heads = [site.heads(layer) for layer in range(spec.num_layers)]
            first = [sum(map(len, heads[:layer])) for layer in range(spec.num_layers)]
            in_host = [first[layer] + place for layer, places in
                       enumerate(host_places(plan, heads)) for place in places]  # fmt: skip
            rings = prefill_rings(plan, heads, spec.page_size)
            pools = PoolLayout(plan.num_gpu_pages, offloaded=tuple(in_host), rings=rings)
        else:
            resident = [head_ranges(plan, layer, site.own_heads(layer))[0]
                        for layer in range(spec.num_layers)]  # fmt: skip
            copies = [] if layout is None else [len(c) for c in layout.copies]
            self.store.layout([r[1] if r else 0 for r in resident] + copies, plan.num_gpu_pages,
                              staging_slots(plan), window_slots(plan, spec.page_size))  # fmt: skip
            same_map = self._layout is not None and self._layout[0] == key[0]
            pools = PoolLayout(plan.num_gpu_pages, drop_host_cache=not same_map)
        self.plan, self._layout = plan, key
        self._layout_id = self._layout_ids.setdefault(key, len(self._layout_ids))
        return pools

    def spare_cpu_cores(self, count: int) -> None:
        """From the next decode step, the hybrid tier's CPU attention leaves ``count`` cores
        to other threads (a resident lane's steps beside this one's)."""
        self._cpu_spared = count

    def kept_summary(self, seq_id: int) -> tuple[float, float, float] | None:
        """Sparse hybrid mode: (min, median, max) share of the CPU-side tokens kept per
        hybrid (layer, kv head) for ``seq_id``; None in other modes."""
        return next((kept for tier in self.tiers
                     if (kept := tier.kept_summary(seq_id)) is not None), None)  # fmt: skip

    def forget(self, seq_id: int) -> None:
        """Drop what the tiers keep of a sequence that ended or was aborted (its pages are
        the scheduler's to free)."""
        for tier in self.tiers:
            tier.forget(seq_id)

    def _resize(self, resize: Resize) -> None:
        """The resident layout over ``resize.num_pages`` pages, its held pages' K/V moved
        (:meth:`PagedKVStore.resize`); graphs of the new layout are captured anew."""
        num_pages = resize.num_pages
        self.store.resize(num_pages, list(resize.moves), resize.held)
        self.plan.num_gpu_pages = num_pages
        key = layout_key(self.plan)
        self._layout = key
        self._layout_id = self._layout_ids.setdefault(key, len(self._layout_ids))

    def _host_pages(self) -> int:
        """Pages the host arena holds (under torchrun the fewest any rank holds)."""
        return host_min(self.host.num_pages) if self.layout is not None else self.host.num_pages

    def _refused(self, message: str) -> UserError:
        """The error for host pages that cannot be had: HostPagesRefused, whose requests
        end alone; under torchrun a UserError that stops every rank alike (the ranks'
        arenas may now differ, and their next growths would not meet)."""
        if self.layout is not None:
            return UserError(message)
        return HostPagesRefused(message, self.host.num_pages)

    def _grow_host(self, num_pages: int, keep: bool, rows: int | None = None) -> int:
        """Host pages for at least ``num_pages`` (grows the arena, copying it when ``keep``:
        some page holds data; graphs that address the old one are then captured again), of
        ``rows`` kv heads a layer when given (per-entry pages: a new arena).
        Returns the pages the host pool may hold now: under torchrun the same on every rank,
        so their schedulers decide alike. Raises UserError when the arena cannot grow; under
        torchrun on every rank alike (page-locking may fail on one)."""
        refused = None
        try:  # (an arena may stay larger than its pool)
            if self.host.ensure(num_pages, keep=keep, rows=rows):  # a decode step's time
                self.hybrid_share.other_work = True  # after a reallocation is not one
        except UserError as error:
            refused = str(error)
        refused = first_error(refused) if self.layout is not None else refused
        if refused is not None:
            raise UserError(refused)
        return self._host_pages()

    # -- decode ------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, seq_ids: list[int], positions: list[int], slots: list[int],
               pages: Pages) -> DecodeResult:  # fmt: skip
        """One token for each sequence: its input is token ``slots[i]``, at ``positions[i]``,
        over ``pages`` (per tier, one table per sequence, already holding the new token's
        place). Returns fp32 logits ``[seqs, vocab]`` and the slots on the device; each
        greedy pick is written into its slot (sampled rows overwrite it); through
        ``decode_hooks`` when there are any."""
        step = partial(self._decode, seq_ids, positions, slots, pages)
        for hook in self.decode_hooks:
            step = partial(hook, seq_ids, step)
        return step()

    def _decode(self, seq_ids: list[int], positions: list[int], slots: list[int],
                pages: Pages) -> DecodeResult:  # fmt: skip
        for tier in self.tiers:  # per-entry tables on the device
            tier.before_decode(seq_ids, slots)
        if self.site.cpu_attention is not None:  # (made with the first hybrid layout)
            self.site.cpu_attention.spared = self._cpu_spared
        graphs = self._graphs
        if graphs is not None and graphs.accepts(positions):
            return graphs.run(slots, positions, pages)
        self.hybrid_share.before_step(seq_ids)
        step = self._decode_inputs(seq_ids, positions, pages)
        for tier in self.tiers:
            tier.begin(step)
        slot_index = device_ints(slots, self.device)
        mode = "dynamic" if self._compiled else "eager"
        hidden = self.model(self.tokens[slot_index], step.positions, self._attention, mode)
        return self._picks(hidden, slot_index)

    def _decode_inputs(self, seq_ids: list[int], positions: list[int],
                       pages: Pages) -> StepInputs:  # fmt: skip
        pos = device_ints(positions, self.device)
        tables = {}
        for tier, rows in pages.items():
            width = bucket(max(map(len, rows)), MIN_WIDTH)
            tables[tier] = device_ints(block_table(rows, width), self.device, torch.int32)
        return StepInputs(True, pos, list(positions), pages, tables, pos + 1,
                          seq_ids=list(seq_ids))  # fmt: skip

    def _picks(self, hidden: torch.Tensor, slot_index: torch.Tensor) -> DecodeResult:
        """The decode rows' fp32 logits from their ``hidden`` states ``[seqs, hidden]``,
        each greedy pick written into its token slot (``slot_index`` on the device)."""
        logits = self.model.logits(hidden)
        self.tokens[slot_index] = logits.argmax(-1)
        return logits, slot_index

    # -- swapping ----------------------------------------------------------------------
    def _swap(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        """Copy the resident entries of page pairs (GPU, host) or (host, GPU). Under torchrun
        a layer's host pages hold the rank's heads in its weights' order: its own (arena
        layer ``l``), then its copies (arena layer ``L + l``)."""
        if pairs:  # the next decode step's time is not one to compare
            self.hybrid_share.other_work = True
        num_layers = self.spec.num_layers
        places = [(i % num_layers, 0 if i < num_layers else len(self.layout.own[i % num_layers]))
                  for i in range(len(self.store.kv))]  # fmt: skip
        swap_pages(self.store.kv, self.host.layer, places, pairs, to_host, self.page_size)


__all__ = ["PagedRunner"]

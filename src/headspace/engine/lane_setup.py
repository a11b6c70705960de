"""What the lanes of an engine are built from, sized once: the page shape, the prefill chunk,
the KV arena and the host budget (from the GPU and host budgets, every rank alike under
torchrun), the planner's rates; and each lane (its block tables, host pages, runner, planner
and scheduler) built over a part of the arena."""

from __future__ import annotations

from headspace.attention.cpu_decode import kernel_isa
from headspace.engine.config import EngineConfig
from headspace.engine.hooks import EngineHooks
from headspace.engine.lane import Lane, LaneContext
from headspace.engine.layout_plan import LaneMemory, LayoutPlanner, PlanTerms
from headspace.engine.memory import (
    attention_prefix,
    check_host_room,
    decode_rates,
    flex_pool_pages,
    kv_arena_bytes,
    prefill_chunk_size,
    rank_host_bytes,
)
from headspace.engine.paged_runner import PagedRunner, RunnerParts
from headspace.engine.ranks import Ranks
from headspace.engine.scheduler import Scheduler, SchedulerSettings
from headspace.engine.weight_stream import device_weight_bytes, streamed_weight_bytes
from headspace.kv.entry_table import block_manager
from headspace.kv.host_store import HostKVArena, HostLedger
from headspace.kv.paged_store import KVArena, PagedKVStore
from headspace.kv.spec import KVSpec
from headspace.model.llama import LlamaModel
from headspace.parallel.dist import all_agree, host_min
from headspace.planner.memory import Hardware
from headspace.planner.profile import Profile
from headspace.tiers.hybrid_blocks import box_bytes_per_kv_byte


def kv_sizes(model: LlamaModel, config: EngineConfig,
             max_context: int) -> tuple[KVSpec, int, int, int, int]:  # fmt: skip
    """(page shape, weight bytes on the device, weight bytes streamed from the host, prefill
    chunk, KV arena bytes) of one process: UserError, with the numbers, when the budget
    leaves nothing for KV, or on the CPU an arena past the host memory available (what the
    lanes will hold, checked when the engine is made)."""
    cfg = model.config
    spec = KVSpec.of(cfg, config.cache.page_size, config.runtime.torch_dtype.itemsize)
    weights, streamed = device_weight_bytes(model), streamed_weight_bytes(model)
    chunk = prefill_chunk_size(cfg, config, weights, max_context, streamed > 0)
    arena = kv_arena_bytes(cfg, config, spec, weights, chunk, max_context)
    if not config.runtime.on_gpu and config.cache.gpu_memory is not None:
        check_host_room(arena)  # (the "GPU" budget is host memory there)
    return spec, weights, streamed, chunk, arena


class LaneFactory:
    """Sizes (``spec``, ``chunk``, ``arena`` of ``arena_bytes``, ``host_bytes`` shared by
    the lanes' host pages through ``ledger``, ``rates``) and lanes over parts of the arena."""

    def __init__(self, model: LlamaModel, config: EngineConfig, max_context: int,
                 profile: Profile | None, ranks: Ranks | None, hooks: EngineHooks):  # fmt: skip
        self.model, self.config, self.max_context = model, config, max_context
        self.profile, self.ranks, self.hooks = profile, ranks, hooks
        self._size(model, config, max_context, ranks)

    def _size(self, model: LlamaModel, config: EngineConfig, max_context: int,
              ranks: Ranks | None) -> None:  # fmt: skip
        """The page shape, prefill chunk, KV arena and host budget (every rank alike)."""
        cfg, dtype = model.config, config.runtime.torch_dtype
        self.spec, self.weight_bytes, self.streamed_bytes, self.chunk, arena = kv_sizes(
            model, config, max_context)  # fmt: skip
        weights, streamed = self.weight_bytes, self.streamed_bytes
        if ranks is not None:  # the same chunks on every rank (their collectives pair up)
            self.chunk = host_min(self.chunk)
            arena = kv_arena_bytes(cfg, config, self.spec, weights, self.chunk, max_context)
        if ranks is not None:  # the same pages on every rank
            self.spec, arena = ranks.pages(self.spec, arena)
        # (the machine's budget, divided between its ranks, the same on every rank)
        host = rank_host_bytes(config.cache.host_memory, ranks.on_host if ranks else 1)
        if config.cache.host_memory is None and not config.runtime.on_gpu:
            host = max(host - arena, 0)  # the arena is host memory too
        host = config.host_kv_bytes(host, box_bytes_per_kv_byte(dtype.itemsize))
        self.host_bytes = host_min(host) if ranks is not None else host
        self.arena_bytes = arena
        self.arena = KVArena(arena, dtype=dtype, device=config.runtime.device)
        self.ledger = HostLedger(self.host_bytes)
        has_kernel = kernel_isa() is not None  # no CPU attention where the kernel does not build
        heaviest, most_streamed = weights, streamed
        if ranks is not None:  # every rank plans alike, also over machines that differ
            has_kernel = all_agree(has_kernel)
            heaviest, most_streamed = -host_min(-weights), -host_min(-streamed)
        self.hardware = self.hooks.hardware or (
            Hardware() if has_kernel else Hardware(cpu_attention_bytes=0)
        )
        self.rates = (heaviest, most_streamed, self.hardware)
        flex = config.runtime.attention_backend == "flex"
        self.plan_terms = PlanTerms(
            cfg, config, self.spec, self.chunk, heaviest, most_streamed, self.hardware,
            self.profile, ranks, flex_pool_pages(self.spec) if flex else None,
            config.entries_per_page(self.spec) is not None)  # fmt: skip

    def planner(self, memory: LaneMemory, budget=None) -> LayoutPlanner:
        """A layout planner within ``memory`` (``budget``: what each entry keeps)."""
        return LayoutPlanner(self.plan_terms, memory, budget)

    def lane(self, name: str, region: int, context: LaneContext,
             resident_only: bool = False) -> Lane:  # fmt: skip
        """A lane over the arena's first ``region`` bytes (the resident or only lane), or over
        nothing yet (the offload lane, given a part when it opens)."""
        config, spec, hooks = self.config, self.spec, self.hooks
        on_gpu, max_batch = config.runtime.on_gpu, config.runtime.max_batch
        host = (hooks.host_arena or HostKVArena)(spec, config.runtime.torch_dtype, pin=on_gpu,
                                                 budget=self.ledger)  # fmt: skip
        layout = self.ranks.layout if self.ranks else None
        blocks = block_manager(spec.page_size, config.entries_per_page(spec, layout))
        store = PagedKVStore(spec, self.arena.part(0 if region else self.arena_bytes))
        parts = RunnerParts(spec, self.arena, store, host, blocks, 2 * max_batch,
                            self.max_context, self.profile, layout)  # fmt: skip
        runner = PagedRunner(self.model, config, parts, hooks)
        memory = LaneMemory(region, self.host_bytes, resident_only, host)
        planner = self.planner(memory, runner.budget)
        settings = SchedulerSettings(
            max_batch, 2 * max_batch, config.cache.prefix_caching, self.chunk,
            self.step_tokens(False), self.model.config.num_layers,
            attention_prefix(self.model.config), self.step_tokens(False, slices=False),
            swaps=config.swaps, prefill_slowdown=config.runtime.slowdown(False),
            decode_rates=decode_rates(self.model.config, config.runtime.torch_dtype.itemsize,
                                      self.hardware.prompt_flops, self.hardware.hbm_bytes),
            mixed_slowdown=config.runtime.slowdown(True),
            mixed_floor=config.runtime.prefill_step_tokens or 0, passes=config.runtime.passes,
        )  # fmt: skip
        ranked = self.ranks is not None
        own_pools = ranked and blocks.per_entry  # pages per rank

        def host_claim(num_pages: int, rows: int | None, keep: bool) -> bool:  # (no cycle)
            return host.claim(num_pages, rows, keep, host_min if ranked else None)

        scheduler = Scheduler(blocks, settings, planner, all_agree if own_pools else bool,
                              host_claim)  # fmt: skip
        return Lane(name, scheduler, runner, context)

    def step_tokens(self, at_once: bool, slices: bool = True) -> int:
        """The prompt work a step carries while others decode (a whole chunk when none
        does), in whole pages."""
        page = self.spec.page_size
        return max(page, self.config.runtime.step_tokens(at_once, slices) // page * page)


__all__ = ["LaneFactory", "kv_sizes"]

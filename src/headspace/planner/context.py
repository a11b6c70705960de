"""The plan ``headspace plan`` prints: the engine's arithmetic for one sequence of a given
context, before anything runs, with its memory table and roofline prediction.

The same functions the engine calls when it forms a batch: :func:`plan_batch` for shared
pages, :func:`plan_entries` where each (layer, kv head) entry has its own pages (KV budgets,
streaming heads). Pure arithmetic; no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from headspace.errors import UserError
from headspace.kv.spec import KVSpec, Pattern
from headspace.model.config import ModelConfig
from headspace.planner.entry_offload import STAGING_DEPTH, check_offload, plan_entries
from headspace.planner.head_map import HeadMap
from headspace.planner.memory import (
    GpuSplit,
    Hardware,
    WeightSpec,
    prefill_chunk,
    prefill_compute_seconds,
    split_gpu_budget,
    streams_weights,
)
from headspace.planner.plan import Plan, plan_batch, step_seconds
from headspace.planner.profile import with_patterns
from headspace.planner.sparsity import (
    arena_after_gathers,
    prefill_gathers,
    resident_shares,
    with_budgets,
)


@dataclass(frozen=True)
class RankShape:
    """One rank's part of a head-parallel engine, as the engine sizes it under torchrun:
    ``world`` ranks; weights of at most ``page_heads`` kv heads a layer (the most any rank
    holds in one, copies included) and a ``1/world`` slice of the MLP; KV pages that wide;
    with per-entry pages, the balanced ``head_map`` (every entry with its ranks) and each
    rank's ``parts`` (its entries, ``[layer]`` its own kv heads), planned alike."""

    world: int
    page_heads: int
    head_map: HeadMap
    parts: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...]


@dataclass(frozen=True)
class PlanRequest:
    """What ``headspace plan`` plans for: context in tokens, budgets in bytes, and the
    patterns (a profile's ``retrieval`` scores ``[layers][kv heads]``) and KV budget."""

    context: int
    gpu_memory: int
    host_memory: int
    dtype_bytes: int = 2
    offload: str = "auto"
    head_group: int | None = None
    prefill_chunk: int | None = None
    page_size: int = 128
    cpu_share: float | None = None
    gpu_window: int = 1024
    budget_tokens: int | None = None  # kept per entry after the prompt (a KV budget)
    entry_bound: int | None = None  # most one entry holds after the prompt (default: budget)
    retrieval: tuple[tuple[float, ...], ...] | None = None  # a profile's head scores
    retrieval_heads: float = 0.5  # share of entries that keep ``full``
    sparse_pattern: str = "streaming(4,1024)"  # the others' pattern
    weights: str = "auto"  # decoder layers resident ("gpu"), streamed, or as they fit
    ranks: RankShape | None = None  # head parallelism: plan the widest rank's part
    window_on_gpu: bool = True  # hybrid: the GPU window's pages kept on the GPU

    @property
    def gathers(self) -> bool:
        """Patterns or budgets: a layer's prefill gathers its keys."""
        return self.retrieval is not None or self.budget_tokens is not None

    @property
    def per_head_pages(self) -> bool:
        """Budgets or streaming heads: each entry has its own pages (as in the engine)."""
        streaming = Pattern.parse(self.sparse_pattern).kind == "streaming"
        return self.budget_tokens is not None or (self.retrieval is not None and streaming)

    def with_patterns(self, head_map: HeadMap) -> HeadMap:
        """``head_map`` with the profile's patterns (unchanged without a profile)."""
        if self.retrieval is None:
            return head_map
        retrieval = [list(row) for row in self.retrieval]
        return with_patterns(head_map, retrieval, self.retrieval_heads, self.sparse_pattern)


def make_plan(config: ModelConfig, request: PlanRequest, hw: Hardware | None = None) -> Plan:
    """The engine's plan for one sequence of ``request.context`` tokens, with its memory
    table and roofline prediction; raises UserError with the numbers when it cannot run.
    With ``request.ranks``, one rank's part: its memory, pages as wide as the widest rank's
    layer, and no roofline (the balance's cost model predicts each rank's step); a plan of
    shared pages is then that rank's map, ``parallel.rank_plan`` spreads it."""
    hw = hw or Hardware()
    if request.context < 1:
        raise UserError(f"context must be a positive number of tokens, got {request.context}")
    context, dtype_bytes, ranks = request.context, request.dtype_bytes, request.ranks
    shard = {} if ranks is None else {"world": ranks.world, "kv_heads": ranks.page_heads}
    streamed = streams_weights(request.weights, config, request.gpu_memory, dtype_bytes,
                               chunk=request.prefill_chunk, **shard)  # fmt: skip
    weight_spec = WeightSpec.of(config, dtype_bytes, streamed, **shard)
    weights = weight_spec.gpu_bytes
    chunk = request.prefill_chunk or prefill_chunk(
        config, request.gpu_memory - weights, context, dtype_bytes, hw, streamed
    )
    split = split_gpu_budget(config, request.gpu_memory, weights, chunk, dtype_bytes)
    spec = KVSpec.of(config, request.page_size, dtype_bytes)
    if ranks is not None:  # the same pages on every rank: as wide as the widest
        spec = replace(spec, num_kv_heads=ranks.page_heads)
    gathered, arena = 0, split.arena
    if request.gathers:
        pattern = None if request.retrieval is None else request.sparse_pattern
        gathered = prefill_gathers(spec.num_kv_heads, config.num_queries_per_kv, spec.head_dim,
                                   dtype_bytes, context, chunk,
                                   budgets=request.budget_tokens is not None,
                                   pattern=pattern)  # fmt: skip
        arena = arena_after_gathers(split.arena, gathered, context)
    what = f"a context of {context} tokens"
    if request.per_head_pages:  # patterns and budgets first, then which entries go to host
        check_offload(request.offload)
        if ranks is None:
            head_map = request.with_patterns(HeadMap.all_gpu(spec.num_layers, spec.num_kv_heads))
            head_map, parts = with_budgets(head_map, request.budget_tokens), None
        else:  # the balanced map (its budgets priced), each rank's entries
            head_map, parts = ranks.head_map, ranks.parts
        bound = request.entry_bound or request.budget_tokens or context
        rings = chunk if request.budget_tokens is None else None  # budgets score every token
        plan = plan_entries(spec, arena, head_map, [context], [bound],
                            offload=request.offload, host_budget=request.host_memory,
                            what=what, parts=parts, ring_chunk=rings)  # fmt: skip
    else:
        plan = plan_batch(spec, arena, spec.pages_for(context),
                          offload=request.offload, head_group=request.head_group,
                          host_budget=request.host_memory, what=what, hw=hw,
                          cpu_share=request.cpu_share, gpu_window=request.gpu_window,
                          window_on_gpu=request.window_on_gpu)  # fmt: skip
        if ranks is None:  # a rank's map gets the patterns where it is spread
            plan.head_map = request.with_patterns(plan.head_map)
    plan.prefill_chunk = chunk
    plan.memory = _memory_table(spec, split, plan, context, gathered, request.per_head_pages,
                                weight_spec.host_bytes)  # fmt: skip
    if ranks is None:
        predict(plan, config, request, hw)
    return plan


def _memory_table(spec: KVSpec, split: GpuSplit, plan: Plan, context: int, gathered: int,
                  per_head_pages: bool, weights_host: int) -> dict[str, int]:  # fmt: skip
    """Bytes by use. The GPU pool is in full pages of the resident entries, or with
    ``per_head_pages`` in pages of one entry (the plane) beside the entry staging slots;
    ``weights_host``: streamed layers in host memory (copied once per forward pass)."""
    epb = spec.entry_page_bytes
    resident_page = plan.head_map.count("gpu") * epb
    if per_head_pages:
        pool = (plan.num_gpu_pages + 1) * epb
        staging = STAGING_DEPTH * plan.entry_staging * epb
    else:
        pool = (plan.num_gpu_pages + 1) * resident_page
        staging = plan.staging.num_bytes if plan.staging else 0
    window = plan.gpu_window.num_bytes if plan.gpu_window else 0
    host = plan.num_host_pages * spec.host_page_bytes(plan.host_rows)  # per-entry: its rows
    working = split.activations + split.allocator_slack + split.decode
    return {
        "weights": split.weights, "gpu_kv": spec.pages_for(context) * resident_page,
        "gpu_pool": pool, "staging": staging, "gpu_window": window,
        "activations": split.activations, "allocator_slack": split.allocator_slack,
        "decode": split.decode, "gathered": gathered,
        "total_gpu": split.weights + pool + staging + window + working + gathered,
        "weights_host": weights_host, "host_kv": host, "total_host": host + weights_host,
    }  # fmt: skip


def predict(plan: Plan, config: ModelConfig, request: PlanRequest,
            hw: Hardware | None = None) -> None:  # fmt: skip
    """Roofline: prefill = max(compute, PCIe traffic); decode = max(HBM reads, PCIe reads).
    The head map's patterns and the request's budget price in: prefill attention by each
    entry's share of causal pairs, decode HBM reads and ``memory["kv_held"]`` by what the
    resident entries hold after the prompt, and an offloaded entry of its own pages streams
    only what it keeps, on average the budget (compressing the prompt reads it back once;
    the engine's choice of batch size prices the most one entry may hold instead). Call
    again after changing the head map."""
    hw = hw or Hardware()
    context, dtype_bytes, chunk = request.context, request.dtype_bytes, plan.prefill_chunk
    held, share = resident_shares(plan.head_map, context, request.budget_tokens)
    per_token = 2 * config.head_dim * dtype_bytes
    plan.memory["kv_held"] = held * per_token
    compute_s = prefill_compute_seconds(config, context, hw, share)
    streamed = plan.head_map.num_offloaded  # prefill streams the hybrid entries too
    num_chunks = -(-context // chunk)
    prefix_tokens = chunk * num_chunks * (num_chunks - 1) // 2  # prefixes re-read per chunk
    streamed_tokens = context  # what an offloaded entry holds at decode
    if plan.entry_staging and request.budget_tokens is not None:
        prefix_tokens += context  # compression gathers the whole prompt once more
        streamed_tokens = min(context, request.budget_tokens)
    weights_pass = plan.memory["weights_host"]  # streamed layers, every chunk
    h2d_s = (streamed * prefix_tokens * per_token + num_chunks * weights_pass) / hw.h2d_bytes
    d2h_s = streamed * context * per_token / hw.d2h_bytes
    plan.prefill_tok_s = context / max(compute_s, h2d_s + d2h_s)
    step_s, pcie_s = step_seconds(config, plan, streamed_tokens, dtype_bytes, hw,
                                  request.cpu_share, held, weights_pass)  # fmt: skip
    plan.decode_ms, plan.decode_pcie_floor_ms = 1000 * step_s, 1000 * pcie_s

"""The planner: for the sequences actually running, which (layer, kv head) entries stay on
the GPU and which stream from host pages, in what groups and staging, and what that costs.

Pure arithmetic on the model config and the budgets: no tensors, no CUDA. The engine calls
:func:`plan_batch` each time it forms a batch (``entry_offload.plan_entries`` where each
entry has its own pages); ``headspace plan`` runs the same arithmetic for one sequence of a
given context, before anything runs (``context.make_plan``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from headspace.errors import HostBudgetError, UserError
from headspace.kv.spec import GiB, KVSpec, byte_size
from headspace.model.config import ModelConfig
from headspace.planner.head_map import HeadEntry, HeadMap
from headspace.planner.memory import Hardware, hybrid_share, offloaded_seconds, weight_bytes

OffloadMode = Literal["auto", "none", "layer", "head", "hybrid"]
OFFLOAD_MODES = get_args(OffloadMode)
# a streamed group moves at least this much per gather (0.6 ms at 54 GB/s): fewer, larger
# gathers (Llama-3.1-8B at 32K on an H100: groups of two heads decoded in 84 ms a graph
# step, of one in 96), and an eager step's copies outlast the host's work per group
MIN_TRANSFER_BYTES = 32 * 2**20
STAGING_SHARE = 2  # staging takes at most half the KV arena (depth beats a resident head)


@dataclass(frozen=True)
class Staging:
    """GPU slots that streamed history is gathered into: ``depth`` slots (one group computes
    while the next ``depth - 1`` arrive), each ``group`` kv heads x ``piece_pages`` pages
    and a scratch page (padded rows of a CUDA-graph step write there); a longer history is
    gathered and attended in pieces merged by LSE."""

    depth: int
    group: int
    piece_pages: int
    entry_page_bytes: int

    @property
    def num_bytes(self) -> int:
        return self.depth * self.group * (self.piece_pages + 1) * self.entry_page_bytes


@dataclass(frozen=True)
class GpuWindowPages:
    """The hybrid tier's GPU window kept in GPU pages (HGCA): for each of ``num_layers``
    layers, ``heads`` kv heads (the most any layer offloads) x ``rows`` sequences x ``pages``
    pages (the window's, and the one its split at a page boundary adds)."""

    num_layers: int
    heads: int
    rows: int
    pages: int
    entry_page_bytes: int

    @property
    def num_bytes(self) -> int:
        return self.num_layers * self.heads * self.rows * self.pages * self.entry_page_bytes


def gpu_window_pages(spec: KVSpec, window: int, num_seqs: int, heads: int,
                     total_pages: int | None = None) -> GpuWindowPages:  # fmt: skip
    """GPU pages for the last ``window`` tokens of ``heads`` kv heads a layer and
    ``num_seqs`` sequences (of at most ``total_pages`` pages each, where given): a
    sequence's GPU side starts at a page boundary at most ``window`` tokens before its new
    token, so it spans at most ``ceil(window / page) + 1`` pages."""
    pages = -(-window // spec.page_size)
    if total_pages is not None:
        pages = min(pages, total_pages)
    return GpuWindowPages(spec.num_layers, heads, num_seqs, pages + 1, spec.entry_page_bytes)


@dataclass
class Plan:
    """The planner's answer; ``memory`` in bytes, predictions in tok/s and ms."""

    head_map: HeadMap
    offload: str  # the mode used: "none" (all resident), "layer", "head" or "hybrid"
    num_gpu_pages: int  # pages of the GPU pool (each holds the resident entries)
    num_host_pages: int  # host pages the batch needs (each holds every entry)
    staging: Staging | None
    prefill_chunk: int
    memory: dict[str, int] = field(default_factory=dict)
    prefill_tok_s: float = 0.0
    decode_ms: float = 0.0
    decode_pcie_floor_ms: float = 0.0
    cpu_share: float = 0.0  # hybrid: share of each history before the window on the CPU
    entry_staging: int = 0  # per-entry pages: entry pages of one staging slot
    host_rows: int = 0  # per-entry pages: kv heads a layer's host page holds (0: all)
    ring_chunk: int = 0  # per-entry pages: the chunk streaming entries' prefill rings fit
    gpu_window: GpuWindowPages | None = None  # hybrid: the window kept in GPU pages
    # under torchrun with heads in host pages: the map the planner sized, one rank's heads as
    # wide as the widest rank's layer (``head_map`` is then the whole map, every rank's)
    rank_map: HeadMap | None = None

    @property
    def head_group(self) -> int:
        """kv heads per streamed group (0: nothing streams)."""
        return self.staging.group if self.staging else 0

    def to_dict(self) -> dict:
        staging = self.staging
        return {
            "offload": self.offload, "head_group": self.head_group,
            "staging_depth": staging.depth if staging else 0,
            "staging_piece_pages": staging.piece_pages if staging else 0,
            "num_gpu_pages": self.num_gpu_pages, "num_host_pages": self.num_host_pages,
            "prefill_chunk": self.prefill_chunk, "memory_bytes": self.memory,
            "prefill_tok_s": self.prefill_tok_s, "decode_ms": self.decode_ms,
            "decode_pcie_floor_ms": self.decode_pcie_floor_ms,
            "entry_staging_pages": self.entry_staging,
            "gpu_window_pages": self.gpu_window.pages if self.gpu_window else 0,
            "head_map_summary": self.head_map.summary(), "head_map": self.head_map.to_dict(),
        }  # fmt: skip


def _staging(spec: KVSpec, arena: int, total_pages: int, mode: str,
             head_group: int | None) -> Staging:  # fmt: skip
    """Group size, depth and piece length of the staging slots, within half the arena
    (more if even the smallest staging needs it)."""
    epb, heads = spec.entry_page_bytes, spec.num_kv_heads
    if mode == "layer":
        group = heads
    elif head_group:
        group = min(head_group, heads)
    else:  # enough heads per group that one gather moves a large block
        group = max(1, min(heads, -(-MIN_TRANSFER_BYTES // (total_pages * epb))))
    cap = arena // STAGING_SHARE
    groups = (group, 1) if mode == "head" and not head_group else (group,)
    for group in dict.fromkeys(groups):  # the whole history in each slot, if it fits
        for depth in (3, 2):
            staging = Staging(depth, group, total_pages, epb)
            if staging.num_bytes <= cap:
                return staging
    piece = max(1, cap // (2 * group * epb) - 1)
    staging = Staging(2, group, min(piece, total_pages), epb)
    if staging.num_bytes > arena:
        raise UserError(
            f"GPU budget too small: streaming needs {staging.num_bytes / GiB:.3f} GiB of staging "
            f"({group} kv head(s) x 2 slots x 2 {spec.page_size}-token pages) but the budget "
            f"leaves {arena / GiB:.3f} GiB for KV after weights and activations"
        )
    return staging


def _hybrid_staging(spec: KVSpec, arena: int, total_pages: int, resident: list[int],
                    share: float, window: int, num_seqs: int,
                    head_group: int | None) -> Staging | None:  # fmt: skip
    """The hybrid tier stages, at decode, only what streams of each history (``1 - share``
    of what precedes the ``window`` most recent tokens, and the window, for each of
    ``num_seqs`` sequences): slots sized for that hold all of a layer's offloaded heads as
    one group, so a layer takes one copy, one attention launch and one merge, and the next
    layer's copy runs while the CPU attends. Where that exceeds half the arena, groups of
    half as many heads, and so on; None when even two slots of one head do."""
    offloaded = max(spec.num_kv_heads - n for n in resident)
    group = min(head_group or offloaded, offloaded)
    window_pages = -(-window // spec.page_size) + 2  # and the pages the split rounds into
    pages = min(total_pages, math.ceil((1 - share) * total_pages) + num_seqs * window_pages)
    while True:
        for depth in (3, 2):
            staging = Staging(depth, group, pages, spec.entry_page_bytes)
            if staging.num_bytes <= arena // STAGING_SHARE:
                return staging
        if group == 1 or head_group:
            return None
        group = -(-group // 2)


def _hybrid_layout(spec: KVSpec, arena: int, total_pages: int, staging: Staging,
                   resident: list[int], share: float, window: int, num_seqs: int,
                   head_group: int | None, window_on_gpu: bool) -> tuple:  # fmt: skip
    """Staging, resident heads per layer and GPU window pages (None: staged) of the hybrid
    tier (see :func:`_hybrid_staging`; the streamed layout's where its slots do not fit).
    The window's pages hold as many heads as a layer offloads, and leave fewer resident:
    sized again until that count holds."""
    sizes = (total_pages, staging, resident, share, window, num_seqs, head_group)
    staged = _hybrid_slots(spec, arena, *sizes)
    (staging, resident), heads, pages = staged, 0, None
    while window_on_gpu:
        offloaded = max(spec.num_kv_heads - n for n in resident)
        if pages is not None and offloaded <= heads:  # what they hold suffices
            return staging, resident, replace(pages, heads=offloaded)
        heads = offloaded
        pages = _window_on_gpu(spec, arena, window, num_seqs, total_pages, heads)
        if pages is None:  # more than the arena can spare
            break
        staging, resident = _hybrid_slots(spec, arena - pages.num_bytes, *sizes)
        if not _holds(spec, arena - pages.num_bytes, staging, resident, total_pages):
            break  # the streamed layout's fallback was sized without the window's pages
    return *staged, None


def _holds(spec: KVSpec, arena: int, staging: Staging, resident: list[int],
           total_pages: int) -> bool:  # fmt: skip
    """Whether ``arena`` holds ``staging`` and the resident entries' ``total_pages`` pages
    (and the scratch page)."""
    per_page = sum(resident) * spec.entry_page_bytes
    return arena - staging.num_bytes >= (total_pages + 1) * per_page


def _hybrid_slots(spec: KVSpec, arena: int, total_pages: int, staging: Staging,
                  resident: list[int], share: float, window: int, num_seqs: int,
                  head_group: int | None) -> tuple[Staging, list[int]]:  # fmt: skip
    """Staging and resident heads per layer of the hybrid tier within ``arena``."""
    for _ in range(2):  # twice: its slots may leave fewer heads resident
        slots = _hybrid_staging(spec, arena, total_pages, resident, share, window, num_seqs,
                                head_group)  # fmt: skip
        if slots is None:
            break
        staging, resident = slots, _num_resident(spec, arena, slots, total_pages, "head")
    offloaded = max(spec.num_kv_heads - n for n in resident)
    if staging.group > offloaded:  # fewer heads resident than planned: smaller slots suffice
        staging = replace(staging, group=offloaded)
    return staging, resident


def _window_on_gpu(spec: KVSpec, arena: int, window: int, num_seqs: int, total_pages: int,
                   heads: int) -> GpuWindowPages | None:  # fmt: skip
    """The hybrid tier's GPU window pages for ``heads`` kv heads a layer; None where they
    would take more than half the arena (as the staging may: the window is then staged from
    host pages every step)."""
    pages = gpu_window_pages(spec, window, num_seqs, heads, total_pages)
    return pages if pages.num_bytes <= arena // STAGING_SHARE else None


def _num_resident(spec: KVSpec, arena: int, staging: Staging, total_pages: int,
                  mode: str) -> list[int]:  # fmt: skip
    """Resident heads per layer: as many entries as fit beside ``staging``."""
    num_resident = (arena - staging.num_bytes) // ((total_pages + 1) * spec.entry_page_bytes)
    num_resident = min(num_resident, spec.num_entries - 1)
    if mode == "layer":
        num_resident -= num_resident % spec.num_kv_heads
    return _resident_counts(num_resident, spec, mode)


def _resident_counts(num_resident: int, spec: KVSpec, mode: str) -> list[int]:
    """Resident heads per layer: whole layers first (layer mode), else spread evenly, the
    layers with one head fewer spaced evenly too, each at the end of its stretch of layers:
    a streamed head's copy then runs beside the layers before it rather than all of them
    waiting at the end (45K tokens with 11 streamed heads, all in the last 11 layers:
    8.6 ms a step against 6.4 for 40K all resident; bench/NOTES.md)."""
    layers, heads = spec.num_layers, spec.num_kv_heads
    if mode == "layer":
        full = num_resident // heads
        return [heads if i < full else 0 for i in range(layers)]
    base, extra = divmod(min(num_resident, layers * heads), layers)
    short = layers - extra  # layers holding ``base``, the others ``base + 1``
    fewer = {-(-(j + 1) * layers // short) - 1 for j in range(short)}
    return [min(heads, base + (0 if i in fewer else 1)) for i in range(layers)]


def _head_map(spec: KVSpec, resident: list[int], group: int, tier: str) -> HeadMap:
    """Resident heads first in each layer, the rest in ``tier`` in groups of ``group``."""
    entries = []
    for layer, num_resident in enumerate(resident):
        for head in range(spec.num_kv_heads):
            if head < num_resident:
                entries.append(HeadEntry(layer, head))
            else:
                index = head - num_resident
                entries.append(HeadEntry(layer, head, tier=tier, group=index // group))
    return HeadMap(spec.num_layers, spec.num_kv_heads, entries)


def _offloaded_layers(head_map: HeadMap) -> int:
    return sum(1 for layer in range(head_map.num_layers) if head_map.offloaded_groups(layer))


def _hybrid_faster(spec: KVSpec, resident: list[int], total_pages: int, hw: Hardware,
                   cpu_share: float | None) -> bool:  # fmt: skip
    """Whether the hybrid tier is predicted to attend the offloaded entries' KV faster
    than streaming it all over PCIe (never without CPU attention on this machine)."""
    if hw.cpu_attention_bytes <= 0:
        return False
    offloaded = spec.num_entries - sum(resident)
    num_bytes = offloaded * total_pages * spec.entry_page_bytes
    layers = sum(1 for n in resident if n < spec.num_kv_heads)
    hybrid_s = offloaded_seconds(num_bytes, layers, True, cpu_share, hw)
    return hybrid_s < offloaded_seconds(num_bytes, layers, False, None, hw)


def plan_batch(spec: KVSpec, arena: int, total_pages: int, *, offload: str = "auto",
               head_group: int | None = None, host_budget: int | None = None,
               what: str = "the batch", hw: Hardware | None = None,
               cpu_share: float | None = None, gpu_window: int = 1024, num_seqs: int = 1,
               auto_hybrid: bool = True, window_on_gpu: bool = False,
               max_gpu_pages: int | None = None) -> Plan:  # fmt: skip
    """Head map, pool sizes and staging for ``num_seqs`` sequences that may reach
    ``total_pages`` pages in all, within ``arena`` bytes of GPU memory for KV (see
    :func:`split_gpu_budget`).

    All resident when the pages fit (one page more is the scratch page of padded graph
    rows); else as many entries resident as fit beside the staging, the rest offloaded to
    host pages (``host_budget`` bytes at most): streamed, or hybrid where asked or, with
    ``auto`` and ``auto_hybrid``, where ``hw``'s rates predict it faster (with the hybrid
    tier's ``cpu_share`` and ``gpu_window``, which size its staging; the share used is in
    the plan; ``window_on_gpu``: the window's pages are kept on the GPU, beside the
    staging, where they take at most half the arena; ``max_gpu_pages``: the most pages a
    layer's pool may hold, where its kernels bound it). Raises UserError with the numbers.
    """
    if offload not in OFFLOAD_MODES:
        raise UserError(f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {offload!r}")
    full, epb = spec.full_page_bytes, spec.entry_page_bytes
    all_resident = HeadMap.all_gpu(spec.num_layers, spec.num_kv_heads)
    if (total_pages + 1) * full <= arena:
        return Plan(all_resident, "none", arena // full - 1, 0, None, 0)
    if offload == "none":
        raise UserError(
            f"{what} needs {byte_size(total_pages * full)} of KV ({total_pages} pages of "
            f"{spec.page_size} tokens) but the GPU budget leaves {byte_size(arena)} for KV; "
            "allow offload (auto, layer, head) or raise the budget"
        )
    mode = "layer" if offload == "layer" else "head"
    staging = _staging(spec, arena, total_pages, mode, head_group)
    resident = _num_resident(spec, arena, staging, total_pages, mode)
    hw = hw or Hardware()
    hybrid = offload == "hybrid" or (
        offload == "auto" and auto_hybrid
        and _hybrid_faster(spec, resident, total_pages, hw, cpu_share)
    )  # fmt: skip
    share = hybrid_share(cpu_share, hw) if hybrid else 0.0
    window = None
    if hybrid:
        staging, resident, window = _hybrid_layout(spec, arena, total_pages, staging, resident,
                                                   share, gpu_window, num_seqs, head_group,
                                                   window_on_gpu)  # fmt: skip
    head_map = _head_map(spec, resident, staging.group, "hybrid" if hybrid else "stream")
    num_resident = head_map.count("gpu")
    free = arena - staging.num_bytes - (window.num_bytes if window else 0)
    gpu_pages = free // (num_resident * epb) - 1 if num_resident else 0
    if max_gpu_pages is not None:  # fewer heads a layer take more pages each, up to this
        gpu_pages = min(gpu_pages, max_gpu_pages)
    host_bytes = total_pages * full
    if host_budget is not None and host_bytes + full > host_budget:  # + the scratch page
        raise HostBudgetError(
            f"{what} needs {byte_size(host_bytes)} of host memory for its KV pages, "
            f"more than the {byte_size(host_budget)} host budget"
        )
    return Plan(head_map, "hybrid" if hybrid else mode, gpu_pages, total_pages, staging, 0,
                cpu_share=share, gpu_window=window)  # fmt: skip


def step_seconds(config: ModelConfig, plan: Plan, tokens: int, dtype_bytes: int,
                 hw: Hardware | None = None, cpu_share: float | None = None,
                 resident_tokens: int | None = None,
                 streamed_weights: int = 0) -> tuple[float, float]:  # fmt: skip
    """Roofline of one decode step over ``tokens`` of KV in all: (seconds, PCIe floor
    seconds). HBM reads weights and resident KV (``resident_tokens`` entry-tokens, default
    every resident entry's ``tokens``); PCIe carries the offloaded KV, or with the hybrid
    tier its ``1 - cpu_share`` (default: the rates' balance) while CPU threads read the
    rest (see :func:`offloaded_seconds`), and ``streamed_weights`` bytes of layers streamed
    from the host; the floor is that of streaming all of it."""
    hw = hw or Hardware()
    per_entry = 2 * tokens * config.head_dim * dtype_bytes
    if resident_tokens is None:
        resident_tokens = plan.head_map.count("gpu") * tokens
    embeddings = config.vocab_size * config.hidden_size * dtype_bytes
    hbm_s = (weight_bytes(config, dtype_bytes) - embeddings
             + resident_tokens * 2 * config.head_dim * dtype_bytes) / hw.hbm_bytes  # fmt: skip
    offloaded = plan.head_map.num_offloaded * per_entry
    hybrid = plan.head_map.count("hybrid") > 0
    layers = _offloaded_layers(plan.head_map)
    offloaded_s = offloaded_seconds(offloaded, layers, hybrid, cpu_share, hw)
    weights_s = streamed_weights / hw.h2d_bytes  # the same link as the offloaded KV
    return max(hbm_s, offloaded_s + weights_s), offloaded / hw.h2d_bytes + weights_s

"""The hybrid tier's CPU side (HGCA): older tokens of offloaded (layer, kv head) entries are
attended by CPU threads where they lie in host pages, and only ``(out, lse)`` crosses PCIe.

Each offloaded entry's history is split per sequence at a page boundary ``cpu_end``: tokens
``0 .. cpu_end - 1`` are attended on the CPU, the rest (at least the ``gpu_window`` most
recent tokens) stream to the GPU as the stream tier's do. With ``cpu_share`` 1 the CPU takes
everything before the window (HGCA); below 1 the history splits between PCIe and the CPU in
that proportion so that both finish together. Exact either way: the parts merge by LSE. The
CPU threads' side: :mod:`headspace.tiers.cpu_attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

from headspace.parallel.launch import rank_cores
from headspace.tiers.base import HeadRange, TierSite
from headspace.tiers.cpu_attention import CpuAttention
from headspace.tiers.hybrid_sparse import SparseSelector


def cpu_ends(lengths: list[int], cpu_share: float, gpu_window: int, page_size: int) -> list[int]:
    """Tokens of each sequence attended on the CPU: ``cpu_share`` of what lies before the
    last ``gpu_window`` tokens (lengths exclude the new token), rounded down to a page."""
    ends = []
    for length in lengths:
        offloaded = max(length - gpu_window, 0)
        ends.append(int(offloaded * cpu_share) // page_size * page_size)
    return ends


@dataclass
class CpuSplit:
    """How the hybrid tier splits each decode step's history: ``share`` of what lies before
    the last ``gpu_window`` tokens goes to the CPU threads of ``attention``."""

    attention: CpuAttention
    share: float
    gpu_window: int


def cpu_split(plan, site: TierSite, groups: list[list[HeadRange]]) -> CpuSplit | None:
    """The hybrid tier's CPU side over each layer's offloaded ``groups`` (one per site: its
    worker thread is kept), at the share the planner sized the staging slots for. Ranks on
    one machine divide its cores, unless the launcher bound each to its own."""
    if plan.offload != "hybrid":
        return None
    settings = site.hybrid
    if site.cpu_attention is None:
        threads = settings.threads or max(rank_cores() - 1, 1)  # the GPU thread's core spared
        site.cpu_attention = CpuAttention(site.host, threads, site.cpu_timings)
    site.cpu_attention.sparse = None
    if settings.sparsity is not None:  # the CPU takes all before the window
        site.cpu_attention.sparse = SparseSelector.over_groups(
            settings, site.spec, groups, site.max_slots, site.store.buffer.device,
            site.cpu_timings)  # fmt: skip
    return CpuSplit(site.cpu_attention, plan.cpu_share, settings.gpu_window)

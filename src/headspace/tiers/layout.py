"""How a plan lays out one runner's arena: which places of each layer's heads are resident
and which stream in what groups, the staging slots, the prefill patterns, and the key that
tells two plans with the same tensors apart. Pure functions of the plan."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from headspace.kv.spec import Pattern, prefill_ring
from headspace.planner.plan import Plan
from headspace.tiers.base import HeadRange


def layout_key(plan: Plan) -> tuple:
    """What the arena's layout and tiers depend on: each entry's tier and group, the GPU
    page count, the staging slots and the mode (the same key gives the same tensors)."""
    tiers = tuple((e.tier, e.group) for e in plan.head_map.entries)
    return tiers, plan.num_gpu_pages, plan.staging, plan.offload, plan.entry_staging, \
        plan.gpu_window  # fmt: skip


def head_ranges(
    plan: Plan, layer: int, heads: Sequence[int] | None = None
) -> tuple[HeadRange | None, list[HeadRange]]:
    """(resident range, streamed group ranges) of ``layer``'s ``heads`` (default: all; under
    torchrun a rank's own, in its weights' order), as places in that list: resident first."""
    entries = plan.head_map.layer(layer)
    entries = entries if heads is None else [entries[h] for h in heads]
    num_resident = sum(e.tier == "gpu" for e in entries)
    assert all(e.tier == "gpu" for e in entries[:num_resident]), "resident heads come first"
    groups: dict[int, list[int]] = {}
    for place, e in enumerate(entries[num_resident:], num_resident):
        groups.setdefault(e.group, []).append(place)
    assert all(g[-1] - g[0] == len(g) - 1 for g in groups.values()), "groups are contiguous"
    ranges = [(g[0], g[-1] + 1) for _, g in sorted(groups.items())]
    return ((0, num_resident) if num_resident else None), ranges


def host_places(plan: Plan, heads: list[Sequence[int]]) -> list[list[int]]:
    """Per layer, the places in ``heads[layer]`` of the entries ``plan`` keeps in host
    pages (per-entry pages: any tier but the GPU)."""
    return [[i for i, h in enumerate(hs) if plan.head_map.entry(layer, h).tier != "gpu"]
            for layer, hs in enumerate(heads)]  # fmt: skip


def staging_slots(plan: Plan) -> tuple[int, int, int] | None:
    """The staging slots' (depth, group, piece pages) of ``plan``, None when none stream."""
    staging = plan.staging
    return (staging.depth, staging.group, staging.piece_pages) if staging else None


def window_slots(plan: Plan, page_size: int) -> tuple[int, int, int] | None:
    """The hybrid tier's GPU window (layers, heads, token slots) of ``plan``, None when its
    window is staged."""
    window = plan.gpu_window
    if window is None:
        return None
    return window.num_layers, window.heads, window.rows * window.pages * page_size


def prefill_patterns(plan: Plan, layer: int, kv_heads: Iterable[int],
                     q_per_kv: int) -> list[Pattern] | None:  # fmt: skip
    """The prefill patterns of ``layer``'s ``kv_heads``, one per query head; None when all
    are full."""
    patterns = [Pattern.parse(plan.head_map.entry(layer, h).pattern) for h in kv_heads]
    if all(p.is_full for p in patterns):
        return None
    return [p for p in patterns for _ in range(q_per_kv)]


def prefill_rings(plan: Plan, heads: list[Sequence[int]],
                  page_size: int) -> tuple[tuple[int, int, int], ...]:  # fmt: skip
    """``(entry, sink pages, ring pages)`` of each resident ``streaming`` entry (numbered
    layer by layer over ``heads[layer]``) prefilled ``plan.ring_chunk`` tokens at a time
    (none without: under KV budgets every entry holds its prompt)."""
    if not plan.ring_chunk:
        return ()
    rings, entry = [], 0
    for layer, hs in enumerate(heads):
        for h in hs:
            e = plan.head_map.entry(layer, h)
            pattern = Pattern.parse(e.pattern)
            if pattern.kind == "streaming" and e.tier == "gpu":
                rings.append((entry, *prefill_ring(page_size, *pattern.params,
                                                   plan.ring_chunk)))  # fmt: skip
            entry += 1
    return tuple(rings)

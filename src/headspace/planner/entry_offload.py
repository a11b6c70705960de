"""Which per-head-page entries (KV budgets, streaming heads) live in host pages when a batch
does not fit the GPU: HeadInfer's App. D layout, streaming heads resident and retrieval heads
offloaded. An offloaded entry streams only the tokens it keeps into one of two staging
slots of the GPU plane, one layer at a time (the next layer's copy runs while this one
attends).

A host page then holds, for each layer, as many kv heads as the fullest layer offloads
(``Plan.host_rows``), not every kv head: the host memory is the offloaded entries'.

Pure arithmetic in entry pages (``page_size`` tokens of one (layer, kv head)); no tensors.
"""

from __future__ import annotations

from dataclasses import replace

from headspace.errors import HostBudgetError, UserError
from headspace.kv.spec import KVSpec, Pattern, byte_size, prefill_ring
from headspace.planner.head_map import HeadMap
from headspace.planner.memory import Hardware
from headspace.planner.plan import Plan

STAGING_DEPTH = 2  # a layer's slot is attended while the next one's fills


def check_offload(offload: str) -> None:
    """UserError unless ``offload`` suits per-entry pages (budgets, streaming heads): they
    offload single kv heads, never whole layers or the hybrid tier."""
    if offload not in ("none", "auto", "head"):
        raise UserError(f"kv_budget and streaming heads offload single kv heads; offload "
                        f"must be 'none', 'auto' or 'head', got {offload!r}")  # fmt: skip


def staging_pages(spec: KVSpec, per_layer: int, bounds: list[int]) -> int:
    """Entry pages of one staging slot: ``per_layer`` offloaded entries of each sequence,
    each holding at most ``bounds[s]`` tokens (its kept tokens and what it generates)."""
    return per_layer * sum(spec.pages_for(bound) for bound in bounds)


def _free_heads(head_map: HeadMap, layer: int, heads) -> list[int]:
    """kv heads of ``layer`` among ``heads`` that may go to host pages: not rings (a
    ``streaming`` entry holds little and stays resident)."""
    return [h for h in heads if Pattern.parse(head_map.entry(layer, h).pattern).kind != "streaming"]


def _part(head_map: HeadMap, num: int, own) -> tuple[int, list[list[int]], int]:
    """``(entries, [layer] own kv heads that may go to host pages, own streaming heads)``
    of a part holding ``num`` entries, ``own[layer]`` its own heads; the rest are copies,
    which stay resident and are counted at the whole prompt's pages, rings or not."""
    free = [_free_heads(head_map, layer, heads) for layer, heads in enumerate(own)]
    rings = sum(len(heads) - len(f) for heads, f in zip(own, free, strict=True))
    return num, free, rings


def _spread(num_offloaded: int, caps: list[int]) -> list[int] | None:
    """``num_offloaded`` entries over the layers, as evenly as ``caps`` allow (None: no
    room)."""
    if num_offloaded > sum(caps):
        return None
    counts = [0] * len(caps)
    for _ in range(num_offloaded):  # one more to the emptiest layer with room
        _, layer = min((n, i) for i, n in enumerate(counts) if n < caps[i])
        counts[layer] += 1
    return counts


def ring_pages(spec: KVSpec, head_map: HeadMap, max_tokens: list[int],
               chunk: int | None) -> int:  # fmt: skip
    """GPU pages one ``streaming`` entry takes for every sequence's prompt, prefilled
    ``chunk`` tokens at a time: its sink and prefill ring
    (:func:`~headspace.kv.spec.prefill_ring`) at most, for the widest pattern of the map
    (without ``chunk``: the whole prompt)."""
    rings = [Pattern.parse(e.pattern) for e in head_map.entries]
    rings = [p.params for p in rings if p.kind == "streaming"]
    if not rings or chunk is None:
        return sum(spec.pages_for(n) for n in max_tokens)
    most = max(sum(prefill_ring(spec.page_size, sink, window, chunk)) for sink, window in rings)
    return sum(min(spec.pages_for(n), most) for n in max_tokens)


def _offload_counts(spec: KVSpec, plane: int, per_entry: int, per_ring: int, bounds: list[int],
                    parts: list[tuple[int, list[list[int]], int]]):  # fmt: skip
    """The fewest offloaded entries per layer with which every part's entries fit ``plane``
    pages (its rings ``per_ring`` pages each, the others ``per_entry``): ``(staging pages
    of one slot, [part][layer] offloaded count)``, None if none fit; ``parts``: (entries,
    [layer] kv heads that may go to host pages, rings) of each part."""
    most = max((len(heads) for _, free, _ in parts for heads in free), default=0)
    for per_layer in range(1, max(most, 1) + 1):
        staging = staging_pages(spec, per_layer, bounds)
        counts = []
        for num, free, num_rings in parts:  # only ``free`` heads leave; copies stay
            room = plane - 1 - STAGING_DEPTH * staging - num_rings * per_ring
            if room < 0:
                return None
            counts.append(_spread(max(num - num_rings - room // per_entry, 0),
                                  [min(per_layer, len(f)) for f in free]))  # fmt: skip
        if all(c is not None for c in counts):
            return staging, counts
    return None


def plan_entries(spec: KVSpec, arena: int, head_map: HeadMap, max_tokens: list[int],
                 bounds: list[int], *, offload: str = "auto", host_budget: int | None = None,
                 what: str = "the batch", parts=None,
                 ring_chunk: int | None = None) -> Plan:  # fmt: skip
    """The plan of per-entry pages for sequences that may reach ``max_tokens`` each, within
    ``arena`` bytes of GPU plane: all resident when every entry fits uncompressed (a
    sequence is compressed only after its prompt), else as few entries as possible in host
    pages, spread evenly over the layers, beside :data:`STAGING_DEPTH` staging slots of
    :func:`staging_pages` (an offloaded entry holds at most ``bounds[s]`` tokens after the
    prompt). ``head_map`` brings the patterns; with ``ring_chunk`` (the prompt's chunk) its
    streaming entries hold only their prefill rings (:func:`ring_pages`; without, the whole
    prompt, as KV budgets need: compression scores every entry's prompt). The plan's
    ``entry_staging`` is the pages of one slot. ``parts``: under torchrun, each rank's
    (entries, [layer] kv heads it may offload) in planes of ``arena`` each, planned alike
    (default: one part, every entry). Raises UserError with the numbers."""
    plane = arena // spec.entry_page_bytes
    per_entry = sum(spec.pages_for(n) for n in max_tokens)  # one entry, every sequence
    per_ring = ring_pages(spec, head_map, max_tokens, ring_chunk)
    if parts is None:  # one process: every entry
        parts = [(spec.num_entries, [range(spec.num_kv_heads)] * spec.num_layers)]
    parts = [_part(head_map, num, own) for num, own in parts]
    needed = max((num - rings) * per_entry + rings * per_ring
                 for num, _, rings in parts)  # the fullest part's pages  # fmt: skip
    if needed + 1 <= plane:
        return Plan(head_map, "none", plane - 1, 0, None, 0, ring_chunk=ring_chunk or 0)
    if offload not in ("auto", "head"):
        raise UserError(
            f"{what} needs {byte_size(needed * spec.entry_page_bytes)} "
            f"of KV before its prompt is compressed, but the GPU budget leaves "
            f"{byte_size(arena)}; allow offload (auto or head) or raise the budget"
        )
    found = _offload_counts(spec, plane, per_entry, per_ring, bounds, parts)
    if found is None:
        raise UserError(
            f"GPU budget too small: {what} needs more kv heads in host pages than it can "
            f"stage, or than keep every token (streaming heads stay on the GPU), within the "
            f"{byte_size(arena)} left for KV; raise the GPU budget"
        )
    staging, counts = found
    offloaded = {
        (layer, h)
        for (_, free, _), part in zip(parts, counts, strict=True)
        for layer, n in enumerate(part)
        for h in free[layer][len(free[layer]) - n :]
    }  # each part's last free heads of a layer
    entries = [replace(e, tier="stream") if (e.layer, e.kv_head) in offloaded else e
               for e in head_map.entries]  # fmt: skip
    host_pages = per_entry
    rows = max(n for part in counts for n in part)  # a host page: the fullest layer's entries
    page_bytes = spec.host_page_bytes(rows)
    if host_budget is not None and (host_pages + 1) * page_bytes > host_budget:
        raise HostBudgetError(
            f"{what} needs {byte_size(host_pages * page_bytes)} of host memory "
            f"for its KV pages, more than the {byte_size(host_budget)} host budget"
        )
    num_pool = plane - 1 - STAGING_DEPTH * staging
    head_map = HeadMap(head_map.num_layers, head_map.num_kv_heads, entries)
    return Plan(head_map, "head", num_pool, host_pages, None, 0, entry_staging=staging,
                host_rows=rows, ring_chunk=ring_chunk or 0)  # fmt: skip


def entry_step_seconds(spec: KVSpec, num_resident: int, num_offloaded: int,
                       bounds: list[int], weight_bytes: int, hw: Hardware,
                       streamed_weights: int = 0) -> float:  # fmt: skip
    """Roofline of a decode step over ``num_resident`` and ``num_offloaded`` entries holding
    at most ``bounds[s]`` tokens each: HBM reads the weights and the resident entries, PCIe
    the offloaded ones and the ``streamed_weights`` bytes of layers streamed from the host."""
    held = sum(bounds) * spec.entry_token_bytes  # one entry, every sequence
    hbm_s = (weight_bytes + num_resident * held) / hw.hbm_bytes
    pcie_bytes = num_offloaded * held + streamed_weights
    return max(hbm_s, pcie_bytes / hw.h2d_bytes)

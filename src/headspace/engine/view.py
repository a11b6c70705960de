"""The engine as it stands, read from its lanes (the offload lane's as it stands on its own
thread): each request with its lane, state and placement, each lane's pages, layout and last
step (:class:`~headspace.engine.outputs.EngineLoad`)."""

from __future__ import annotations

import dataclasses

import torch

from headspace.engine.lane import Lane
from headspace.engine.outputs import EngineLoad, LaneView, RequestView
from headspace.kv.block_table import GPU, HOST
from headspace.model.compile_meter import COMPILE_METER


def engine_view(lanes: list[Lane], queued: list, shown: Lane, device: str | None) -> EngineLoad:
    """The view of ``lanes`` and the requests ``queued`` for the offload lane's part of the
    arena; the head map's entries are ``shown``'s layout (the offload lane's while it runs);
    peak reserved GPU memory of ``device`` (None: the CPU)."""
    requests = [view for lane in lanes for view in _request_views(lane)]
    requests += [RequestView(r.seq.seq_id, "queued", "waiting", len(r.seq.prompt_ids), 0)
                 for r in list(queued)]  # fmt: skip
    views = [_lane_view(lane) for lane in lanes]
    plan = shown.runner.plan
    entries = {t: plan.head_map.count(t) if plan else 0 for t in ("gpu", "stream", "hybrid")}
    states = [r.state for r in requests]
    reserved = torch.cuda.max_memory_reserved(device) if device is not None else 0
    return EngineLoad(
        running=states.count("prefilling") + states.count("decoding"),
        waiting=states.count("waiting"), swapped=states.count("swapped"),
        gpu_pages_used=sum(v.gpu_pages_used for v in views),
        host_pages_used=sum(v.host_pages_used for v in views),
        resident_entries=entries["gpu"], streamed_entries=entries["stream"],
        hybrid_entries=entries["hybrid"],
        num_swaps=sum(lane.scheduler.num_swaps for lane in lanes),
        peak_reserved_bytes=reserved, compile_seconds=COMPILE_METER.seconds,
        requests=tuple(requests), lanes=tuple(views),
    )  # fmt: skip


def _request_views(lane: Lane) -> list[RequestView]:
    """Each request of ``lane`` as it stands (read from the engine's thread)."""
    scheduler, plan = lane.scheduler, lane.runner.plan
    placement = {t: plan.head_map.count(t) for t in ("gpu", "stream", "hybrid")} if plan else {}
    running, swapped = (
        {id(s) for s in list(scheduler.running)},
        {id(s) for s in list(scheduler.swapped)},
    )
    views = []
    for request in lane.requests():
        seq = request.seq
        if id(seq) in swapped:
            state = "swapped"
        elif id(seq) not in running:
            state = "waiting"
        else:
            state = "decoding" if seq.started else "prefilling"
        views.append(RequestView(seq.seq_id, lane.name, state, len(seq.prompt_ids),
                                 len(seq.output_ids),
                                 placement if state != "waiting" else {}))  # fmt: skip
    return views


def _lane_view(lane: Lane) -> LaneView:
    runner, step = lane.runner, lane.last_step
    pools, plan = lane.scheduler.blocks.pools, runner.plan
    gpu, host = pools[GPU], pools[HOST]
    return LaneView(lane.name, gpu.num_pages, gpu.num_pages - gpu.num_free, host.num_pages,
                    host.num_pages - host.num_free, lane.scheduler.planner.memory.region,
                    None if plan is None else plan.head_map.summary(),
                    None if step is None else step.summary(), plan, lane.peak_pages,
                    dataclasses.asdict(runner.site.counters), lane.steps,
                    lane.prefilled_tokens, runner.host.num_bytes, runner.has_graphs,
                    runner.has_mixed_graphs, runner.cpu_share)  # fmt: skip


__all__ = ["engine_view"]

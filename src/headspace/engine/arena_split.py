"""How the KV arena is split between the resident lane and the offload lane.

When a request needs the offload lane and that lane holds nothing, the arena is split: the
resident lane keeps the pages its requests may reach (those running, swapped out, and
waiting since before it), its K/V moved into the smaller pool (:meth:`Scheduler.resize`),
and the offload lane lays out the rest for the requests handed to it, against the budget
the others leave (where that gives it at least ``BESIDE_RATE`` of the rate the whole arena
would, else it waits, and the resident lane admits nobody who came after it). Requests
added one by one (a server's) keep at least ``resident_reserve`` of the arena's pages in the
resident lane where the offload lane's request still starts beside them, so that short
requests arriving after a long one run at once instead of waiting for it to end. Once the
offload lane holds nothing again, the resident lane takes the whole arena back.
"""

from __future__ import annotations

from collections import deque

import torch

from headspace.engine.config import EngineConfig
from headspace.engine.lane import Lane
from headspace.engine.lane_setup import LaneFactory
from headspace.engine.lane_worker import LaneWorker
from headspace.engine.requests import Request
from headspace.engine.step_plan import Sequence
from headspace.errors import UserError
from headspace.kv.paged_store import resident_bytes

BESIDE_RATE = 0.5  # see the module's docstring
# CPU cores the offload lane's CPU attention leaves while the resident lane runs: the
# engine's thread and the server's event loop each keep one (bench/NOTES.md)
SPARED_BESIDE = 2


class ArenaSplit:
    """The split of ``parts``' arena between the ``resident`` lane and the ``offload`` lane
    (stepped by ``worker``), and the requests waiting for the offload lane's part;
    ``whole``: the planner of the whole arena (a request's rate alone)."""

    def __init__(self, resident: Lane, offload: Lane, worker: LaneWorker, whole,
                 parts: LaneFactory, config: EngineConfig):  # fmt: skip
        self.resident, self.offload, self.worker, self.whole = resident, offload, worker, whole
        self.parts, self.config, self.spec = parts, config, parts.spec
        self.full_pages = parts.arena_bytes // self.spec.full_page_bytes - 1
        self.waiting: deque[Request] = deque()  # for the offload lane's part of the arena
        self.handed: dict[int, Request] = {}  # given to the offload lane's thread, not ended
        self.open = False  # the offload lane holds a part of the arena
        self.opening: int | None = None  # the resident pages once the split is made
        self._spared = 0  # CPU cores the offload lane's attention leaves (last given)
        # resident pages kept beside the offload lane (requests given at once: none)
        self.reserve = int(config.cache.resident_reserve * self.full_pages)

    def given_at_once(self, at_once: bool) -> None:
        """Requests given at once (``generate``) keep no resident reserve."""
        share = 0 if at_once else self.config.cache.resident_reserve
        self.reserve = int(share * self.full_pages)

    # -- requests for the offload lane ---------------------------------------------------
    def add(self, request: Request) -> None:
        """``request`` to the offload lane: handed now if its part is laid out, else queued."""
        if self.open:
            self.hand(request)
        else:
            self.waiting.append(request)

    def hand(self, request: Request) -> None:
        """Give ``request`` to the offload lane (on its thread, at its next command)."""
        self.handed[request.seq.seq_id] = request
        self.worker.submit(lambda lane: lane.add(request))

    def ended(self, request_id: int) -> None:
        """Request ``request_id`` ended or was aborted: the offload lane no longer holds it."""
        self.handed.pop(request_id, None)

    def take_waiting(self, request_id: int) -> Request | None:
        """Remove and return the queued request ``request_id`` (None: not queued)."""
        waiting = next((r for r in self.waiting if r.seq.seq_id == request_id), None)
        if waiting is not None:
            self.waiting.remove(waiting)
        return waiting

    def in_transit(self) -> list[Request]:
        """Requests given to the offload lane that its thread has not taken yet."""
        taken = {r.seq.seq_id for r in self.offload.requests()}
        return [r for r in list(self.handed.values())
                if r.seq.seq_id not in taken and r.seq.finish_reason is None]  # fmt: skip

    def clear(self) -> None:
        self.waiting.clear()
        self.handed.clear()

    # -- the split -----------------------------------------------------------------------
    def make_room(self) -> None:
        """While the resident lane runs beside it, have the offload lane leave room for its
        steps: its CPU attention ``SPARED_BESIDE`` cores, its prompt pieces part of the
        GPU's SMs (from its next step); all of both otherwise."""
        beside = self.open and self.resident.has_running()
        self.worker.beside = beside
        count = SPARED_BESIDE if beside else 0
        if count != self._spared:
            self._spared = count
            self.worker.submit(lambda lane: lane.runner.spare_cpu_cores(count))

    def place(self) -> None:
        """Split the arena for the request next in line for the offload lane, or give the
        resident lane the whole arena back once the offload lane holds nothing (no request
        waits for it or was handed to it and has not ended)."""
        if self.opening is not None:
            return
        if self.open:
            if self.worker.idle and not self.waiting and not self.handed:
                self.close_offload()
            return
        if not self.waiting:  # (the one the resident lane let go first may have been aborted)
            self.resident.scheduler.admit_before = None
            return
        head = self.waiting[0].seq
        scheduler = self.resident.scheduler
        for before in (None, head.seq_id):  # all the resident lane's requests, else earlier
            need = self._resident_need(before)
            for pages in [] if need is None else dict.fromkeys((max(need, self.reserve), need)):
                if self._starts_beside(head, pages):
                    scheduler.admit_before = None
                    self.set_resident_pages(pages)
                    self.opening = pages
                    return
        scheduler.admit_before = head.seq_id  # the resident lane lets it go first

    def _resident_need(self, before: int | None) -> int | None:
        """The pages the resident lane keeps beside the offload lane: what its requests
        running, swapped out and waiting (all, or those since before request ``before``)
        may reach (None when that is the whole arena)."""
        scheduler = self.resident.scheduler
        seqs = scheduler.running + list(scheduler.swapped)
        seqs += [s for s in scheduler.waiting if before is None or s.seq_id < before]
        pages = sum(self.spec.pages_for(s.max_tokens) for s in seqs)
        pool = scheduler.blocks.pool
        pages = max(pages, pool.num_pages - pool.num_free if scheduler.plan else 0)
        return None if pages and pages >= self.full_pages else pages

    def _starts_beside(self, head: Sequence, pages: int) -> bool:
        """Whether ``head`` has a plan in what ``pages`` resident pages leave, at least
        ``BESIDE_RATE`` of its rate in the whole arena."""
        memory = self.offload.scheduler.planner.memory
        memory.region = self.parts.arena_bytes - self.resident_bytes(pages)
        planner = self.offload.scheduler.planner
        try:
            beside = planner.rate(planner.plan([head]), [head])
        except UserError:
            return False
        alone = self.whole.rate(self.whole.plan([head]), [head])
        return beside >= BESIDE_RATE * alone

    def resident_bytes(self, pages: int) -> int:
        """Bytes of the resident lane's part for ``pages`` pages (none at all for 0: the
        offload lane takes the whole arena)."""
        heads = [self.spec.num_kv_heads] * self.spec.num_layers
        return resident_bytes(self.spec, heads, pages) if pages else 0

    def set_resident_pages(self, pages: int) -> None:
        """The resident lane over ``pages`` pages: resized under what its sequences hold, or
        laid out anew at its next layout step."""
        scheduler = self.resident.scheduler
        scheduler.planner.memory.region = self.resident_bytes(pages)
        scheduler.set_pages(pages)

    def open_offload(self) -> None:
        """Hand the offload lane the arena past the resident pages and the requests waiting
        for it; its stream first waits for the resident lane's work so far."""
        pages, self.opening = self.opening, None
        start = self.resident_bytes(pages)
        part = self.parts.arena.part(start)
        ready = None
        if self.resident.runner.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()

        def take_part(lane: Lane) -> None:
            if ready is not None:
                torch.cuda.current_stream().wait_event(ready)
            lane.runner.rebind(part)
            lane.scheduler.planner.memory.region = part.nbytes
            lane.scheduler.replan()

        self.worker.submit(take_part)
        while self.waiting:
            self.hand(self.waiting.popleft())
        self.resident.scheduler.chunk_limit = self.parts.step_tokens(False, slices=False)
        self.open = True

    def close_offload(self) -> None:
        """The resident lane takes the whole arena back, after the offload lane's last work."""
        if self.worker.idle_event is not None:
            torch.cuda.current_stream().wait_event(self.worker.idle_event)
        self.set_resident_pages(self.full_pages)
        self.resident.scheduler.chunk_limit = None
        self.open = False

    def take_whole(self) -> None:
        """The offload lane over the whole arena, now, on this thread (its worker idle):
        teacher forcing or a benchmark lays it out for requests that need it."""
        if self.worker.idle_event is not None:
            torch.cuda.current_stream().wait_event(self.worker.idle_event)
        self.set_resident_pages(0)
        runner = self.offload.runner
        runner.rebind(self.parts.arena.part(self.resident_bytes(0)))
        self.offload.scheduler.planner.memory.region = runner.store.num_bytes
        self.open = True  # (the next step gives the resident lane the arena back)


__all__ = ["BESIDE_RATE", "SPARED_BESIDE", "ArenaSplit"]

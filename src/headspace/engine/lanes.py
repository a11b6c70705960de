"""Where each request runs, and how the KV arena is split between the lanes.

In one process with resident weights and shared pages (the default), two lanes share the
GPU, each at its own speed:

- the **resident lane**, stepped on the engine's thread over the front of the arena, all
  resident, its decode steps in CUDA graphs: every request whose KV fits the whole arena;
- the **offload lane**, stepped on a thread and a CUDA stream of its own over the rest:
  requests that need heads streamed from host pages or attended on the CPU. Its copies and
  CPU jobs never stand between two resident steps.

When a request needs the offload lane and that lane holds nothing, the arena is split: the
resident lane keeps the pages its requests may reach (those running, swapped out, and
waiting since before it), its K/V moved into the smaller pool (:meth:`Scheduler.resize`),
and the offload lane lays out the rest for the requests handed to it, against the budget
the others leave (where that gives it at least ``BESIDE_RATE`` of the rate the whole arena
would, else it waits, and the resident lane admits nobody who came after it). Once the
offload lane holds nothing again, the resident lane takes the whole arena back.

Elsewhere (per-entry pages, torchrun, streamed weights) one lane on the engine's thread
takes every request, its layout chosen each time nothing holds pages.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import deque

import torch

from headspace.engine.config import EngineConfig
from headspace.engine.detokenize import StopStringStreamer
from headspace.engine.hooks import EngineHooks
from headspace.engine.lane import Lane, LaneContext
from headspace.engine.lane_setup import LaneFactory
from headspace.engine.lane_worker import LaneWorker
from headspace.engine.layout_plan import LaneMemory
from headspace.engine.outputs import EngineLoad, RequestOutput
from headspace.engine.ranks import Ranks
from headspace.engine.requests import Request
from headspace.engine.sampling import SamplingParams, make_generator
from headspace.engine.step_plan import Sequence
from headspace.engine.view import engine_view
from headspace.errors import UserError
from headspace.kv.paged_store import resident_bytes
from headspace.model.llama import LlamaModel
from headspace.planner.plan import Plan
from headspace.planner.profile import Profile

BESIDE_RATE = 0.5  # see the module's docstring
OFFLOAD_WAIT_S = 0.05  # a step with only the offload lane at work waits this long for it


class Lanes:
    """The engine's lanes over one KV arena, and the requests in them."""

    def __init__(self, model: LlamaModel, tokenizer, config: EngineConfig,
                 eos_token_ids: set[int], max_context: int, profile: Profile | None = None,
                 ranks: Ranks | None = None, hooks: EngineHooks | None = None):  # fmt: skip
        self.hooks = hooks = hooks or EngineHooks()
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.max_context, self.profile, self.ranks = max_context, profile, ranks
        self.parts = parts = LaneFactory(model, config, max_context, profile, ranks, hooks)
        self.spec, self.chunk, self.arena, self.arena_bytes = (
            parts.spec, parts.chunk, parts.arena, parts.arena_bytes)  # fmt: skip
        self.host_bytes, self.hardware, self.rates = parts.host_bytes, parts.hardware, parts.rates
        context = LaneContext(config, self.spec, frozenset(eos_token_ids), ranks,
                              hooks.logits_filter, hooks.lane_step)  # fmt: skip
        self.shared = config.shares_gpu(streamed=parts.streamed_bytes > 0, ranked=ranks is not None)
        self.resident = parts.lane("resident" if self.shared else "main", self.arena_bytes,
                                   context, resident_only=self.shared)  # fmt: skip
        self.offload = parts.lane("offload", 0, context) if self.shared else None
        self.worker = LaneWorker(self.offload) if self.shared else None
        self._priority_stream = None  # the resident lane's beside an offload lane (a GPU's)
        if self.shared and config.runtime.on_gpu:
            self._priority_stream = torch.cuda.Stream(config.runtime.device, priority=-1)
        if self.worker is not None:  # its thread stops with the lanes, or at exit
            weakref.finalize(self, self.worker.close)
        # what the whole arena holds: every request is checked against it
        self.whole = parts.planner(LaneMemory(self.arena_bytes, self.host_bytes),
                                   self.resident.runner.budget)  # fmt: skip
        self.full_pages = self.arena_bytes // self.spec.full_page_bytes - 1
        self._next_id = 0
        self._lane_of: dict[int, Lane] = {}  # every request not returned finished, by id
        self._waiting: deque[Request] = deque()  # for the offload lane's part of the arena
        self._aborted: list[RequestOutput] = []  # of requests never handed to a lane
        self._open = False  # the offload lane holds a part of the arena
        self._opening: int | None = None  # the resident pages once the split is made

    def given_at_once(self, at_once: bool) -> None:
        """Whether the requests now added come as one batch (``generate``: the step budget
        for throughput) or one by one (a server: for the running requests' pace)."""
        step, piece = self.parts.step_tokens(at_once), self.parts.step_tokens(at_once, slices=False)

        def set_budget(lane: Lane) -> None:
            lane.scheduler.step_tokens, lane.scheduler.piece_tokens = step, piece

        set_budget(self.resident)
        if self.worker is not None:
            self.worker.submit(set_budget)

    # -- requests ------------------------------------------------------------------------
    def check(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """The sequence a request would be; UserError, with the numbers, for a prompt past
        the context or one that no plan of the whole arena can hold."""
        self.check_length(len(prompt_ids), room_for_one=True)
        max_tokens = min(len(prompt_ids) + params.max_new_tokens, self.max_context)
        seq = Sequence(self._next_id, list(prompt_ids), max_tokens)
        self.whole.plan([seq])  # refuses, with the numbers, what no plan can hold
        return seq

    def check_length(self, num_tokens: int, room_for_one: bool) -> None:
        """Refuse an empty prompt or one past the context (with ``room_for_one``, a prompt
        must leave room for a generated token)."""
        if num_tokens == 0:
            raise UserError("the prompt is empty")
        if num_tokens + room_for_one > self.max_context:
            raise UserError(
                f"the prompt has {num_tokens} tokens, which does not fit the context of "
                f"{self.max_context} tokens (raise it explicitly with max_context / --max-context)"
            )

    def add(self, prompt_ids: list[int], params: SamplingParams,
            prompt: str | list[int] | None = None) -> int:  # fmt: skip
        """Queue a request (token ids) in its lane; returns its id. Refuses, with the
        numbers, a prompt that no plan can hold."""
        seq = self.check(prompt_ids, params)
        self._next_id += 1
        request = Request(seq, params, make_generator(params, self.resident.runner.device),
                          StopStringStreamer(self.tokenizer, params.stop), time.perf_counter(),
                          prompt_ids if prompt is None else prompt)  # fmt: skip
        if self.shared and self.spec.pages_for(seq.max_tokens) > self.full_pages:
            self._lane_of[seq.seq_id] = self.offload
            if self._open:
                self.worker.submit(lambda lane: lane.add(request))
            else:
                self._waiting.append(request)
        else:
            self._lane_of[seq.seq_id] = self.resident
            self.resident.add(request)
        return seq.seq_id

    def abort(self, request_id: int) -> bool:
        """Drop a request wherever it is; its pages go back (the offload lane's between two
        of its steps) and a coming step returns it with ``finish_reason`` "abort"."""
        lane = self._lane_of.pop(request_id, None)  # (its output still comes)
        if lane is None:
            return False
        if lane is self.resident:
            return self.resident.abort(request_id)
        waiting = next((r for r in self._waiting if r.seq.seq_id == request_id), None)
        if waiting is not None:
            self._waiting.remove(waiting)
            waiting.ended, waiting.finished = "aborted", time.perf_counter()
            waiting.seq.finish_reason = "abort"
            self._aborted.append(waiting.output(None))
            return True
        self.worker.submit(lambda lane: lane.abort(request_id))
        return True

    def abort_all(self) -> None:
        """Abort every request and forget them (nothing is returned; every page goes back)."""
        try:
            self.resident.abort_all()
            if self.worker is not None:
                self.worker.submit(lambda lane: lane.abort_all())
                while not self.worker.idle and self.worker.error is None:
                    self.worker.wait(OFFLOAD_WAIT_S)
                self.worker.take()
        finally:
            self._waiting.clear()
            self._aborted.clear()
            self._lane_of.clear()

    def has_unfinished(self) -> bool:
        """Whether a request is waiting, running, has tokens on their way, an ended one is
        still to be returned, or the arena is still split for an offload lane that ended."""
        busy = self.worker is not None and not self.worker.done
        return bool(self._lane_of or self._aborted) or busy or self._open or \
            self.resident.has_unfinished()  # fmt: skip

    def has_running(self) -> bool:
        return bool(self._lane_of) or self.resident.has_running()

    def prefilling(self) -> int | None:
        """The request whose prompt is being prefilled on the engine's thread, else the
        offload lane's (None between prompts)."""
        found = self.resident.prefilling()
        return found if found is not None or self.offload is None else self.offload.prefilling()

    # -- steps ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step of the resident lane (after the split changes it), and what the offload
        lane has produced since the last step; when only the offload lane has work, waits a
        while for it."""
        self._place()
        outputs, self._aborted = self._aborted, []
        if self.resident.has_unfinished():
            with self._resident_stream():
                outputs += self.resident.step()
        if self._opening is not None and not self.resident.scheduler.has_work_due:
            self._open_offload()
        if self.worker is not None:
            outputs += self.worker.take()
            if not outputs and not self.resident.holds_pages() and not self.worker.idle:
                self.worker.wait(OFFLOAD_WAIT_S)  # (nothing else runs: no spinning)
                outputs += self.worker.take()
        for output in outputs:
            if output.finished:
                self._lane_of.pop(output.request_id, None)
        if self._open and not outputs:  # (the arena back at once once it ended)
            self._place()
        return outputs

    @contextlib.contextmanager
    def _resident_stream(self):
        """Beside an offload lane on a GPU, the resident lane's work goes to a stream of a
        higher priority than the offload lane's (its kernels are scheduled first where both
        wait for the GPU), ordered after and before the caller's stream."""
        stream = self._priority_stream
        if stream is None:
            yield
            return
        caller = torch.cuda.current_stream()
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            yield
        caller.wait_stream(stream)

    def _place(self) -> None:
        """Split the arena for the request next in line for the offload lane, or give the
        resident lane the whole arena back once the offload lane holds nothing."""
        if self.offload is None or self._opening is not None:
            return
        offloaded = any(lane is self.offload for lane in self._lane_of.values())
        if self._open:
            if self.worker.idle and not self._waiting and not offloaded:
                self._close_offload()
            return
        if not self._waiting:  # (the one the resident lane let go first may have been aborted)
            self.resident.scheduler.admit_before = None
            return
        head = self._waiting[0].seq
        scheduler = self.resident.scheduler
        for before in (None, head.seq_id):  # all the resident lane's requests, else earlier
            pages = self._resident_need(before)
            if pages is not None and self._starts_beside(head, pages):
                scheduler.admit_before = None
                self._set_resident_pages(pages)
                self._opening = pages
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
        memory.region = self.arena_bytes - self._resident_bytes(pages)
        planner = self.offload.scheduler.planner
        try:
            beside = planner.rate(planner.plan([head]), [head])
        except UserError:
            return False
        alone = self.whole.rate(self.whole.plan([head]), [head])
        return beside >= BESIDE_RATE * alone

    def _resident_bytes(self, pages: int) -> int:
        """Bytes of the resident lane's part for ``pages`` pages (none at all for 0: the
        offload lane takes the whole arena)."""
        heads = [self.spec.num_kv_heads] * self.spec.num_layers
        return resident_bytes(self.spec, heads, pages) if pages else 0

    def _set_resident_pages(self, pages: int) -> None:
        """The resident lane over ``pages`` pages: resized under what its sequences hold, or
        laid out anew at its next layout step."""
        scheduler = self.resident.scheduler
        scheduler.planner.memory.region = self._resident_bytes(pages)
        scheduler.set_pages(pages)

    def _open_offload(self) -> None:
        """Hand the offload lane the arena past the resident pages and the requests waiting
        for it; its stream first waits for the resident lane's work so far."""
        pages, self._opening = self._opening, None
        start = self._resident_bytes(pages)
        part = self.arena.part(start)
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
        while self._waiting:
            request = self._waiting.popleft()
            self.worker.submit(lambda lane, r=request: lane.add(r))
        self.resident.scheduler.chunk_limit = self.parts.step_tokens(False, slices=False)
        self._open = True

    def _close_offload(self) -> None:
        """The resident lane takes the whole arena back, after the offload lane's last work."""
        if self.worker.idle_event is not None:
            torch.cuda.current_stream().wait_event(self.worker.idle_event)
        self._set_resident_pages(self.full_pages)
        self.resident.scheduler.chunk_limit = None
        self._open = False

    # -- what it holds -------------------------------------------------------------------
    def lane(self, name: str) -> Lane:
        """The lane of that name ("resident", "offload" or "main"): for tests and benchmarks
        that need a runner's internals beyond :meth:`load`'s view."""
        lanes = {lane.name: lane for lane in (self.resident, self.offload) if lane is not None}
        return lanes[name]

    def load(self) -> EngineLoad:
        """Requests by state and lane with their placements, pages in use per tier, each
        lane's layout and last step, swaps so far (the offload lane's read as it stands)."""
        lanes = [self.resident] + ([self.offload] if self.offload is not None else [])
        shown = self.offload if self._open and self.offload.runner.plan else self.resident
        runtime = self.config.runtime
        return engine_view(lanes, list(self._waiting), shown,
                           runtime.device if runtime.on_gpu else None)  # fmt: skip

    def logits(self, token_ids: list[int], decode_tokens: int = 0) -> torch.Tensor:
        """fp32 logits ``[len(token_ids), vocab]`` (CPU) through the paged prefill path; the
        last ``decode_tokens`` rows come from decode steps fed the given tokens (teacher
        forcing), so they run what generation runs (the hybrid tier, its sparse mode).
        Nothing may run: the lane that holds the tokens takes the whole arena."""
        self.check_length(len(token_ids), room_for_one=False)
        if not 0 <= decode_tokens < len(token_ids):
            raise UserError(f"decode_tokens must be in [0, {len(token_ids) - 1}], got "
                            f"{decode_tokens}")  # fmt: skip
        seq = Sequence(self._next_id, list(token_ids[: len(token_ids) - decode_tokens]),
                       len(token_ids))  # fmt: skip
        self._next_id += 1
        _, lane = self.prepare([seq])
        return lane.score(seq, token_ids, self.chunk)

    def prepare(self, seqs: list[Sequence]) -> tuple[Plan, Lane]:
        """Lay out the lane that would run ``seqs`` together for them alone (nothing may
        run; the offload lane takes the whole arena when they need it) and return the plan
        and the lane, for teacher forcing and for a benchmark that drives the lane's runner
        over pages it allocates itself. UserError with the numbers when no plan holds
        them."""
        if self.has_running():
            raise UserError("requests are running: the layout cannot change under them")
        lane = self.resident
        pages = sum(self.spec.pages_for(s.max_tokens) for s in seqs)
        if self.shared and pages > self.full_pages:
            lane = self.offload  # run here, on this thread: its worker is idle
            if self.worker.idle_event is not None:
                torch.cuda.current_stream().wait_event(self.worker.idle_event)
            self._set_resident_pages(0)
            lane.runner.rebind(self.arena.part(self._resident_bytes(0)))
            lane.scheduler.planner.memory.region = lane.runner.store.num_bytes
            self._open = True  # (the next step gives the resident lane the arena back)
        elif self._open:
            self._close_offload()
        lane.scheduler.laid_out(lane.runner.prepare(lane.scheduler.layout_for(seqs)))
        return lane.runner.plan, lane

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


__all__ = ["BESIDE_RATE", "Lanes"]

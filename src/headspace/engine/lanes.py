"""Where each request runs, and how the KV arena is split between the lanes.

In one process with resident weights and shared pages (the default), two lanes share the
GPU, each at its own speed:

- the **resident lane**, stepped on the engine's thread over the front of the arena, all
  resident, its decode steps in CUDA graphs: every request whose KV fits the whole arena;
- the **offload lane**, stepped on a thread and a CUDA stream of its own over the rest:
  requests that need heads streamed from host pages or attended on the CPU. Its copies and
  CPU jobs never stand between two resident steps.

How the arena is split between them: :mod:`headspace.engine.arena_split`.

Elsewhere (per-entry pages, torchrun, streamed weights) one lane on the engine's thread
takes every request, its layout chosen each time nothing holds pages.
"""

from __future__ import annotations

import contextlib
import time
import weakref

import torch

from headspace.engine.arena_split import ArenaSplit
from headspace.engine.config import EngineConfig
from headspace.engine.detokenize import StopStringStreamer
from headspace.engine.hooks import EngineHooks
from headspace.engine.lane import Lane, LaneContext
from headspace.engine.lane_setup import LaneFactory
from headspace.engine.lane_worker import LaneWorker, confined_sms
from headspace.engine.layout_plan import LaneMemory
from headspace.engine.outputs import EngineLoad, RequestOutput
from headspace.engine.ranks import Ranks
from headspace.engine.requests import Request
from headspace.engine.sampling import SamplingParams, make_generator
from headspace.engine.step_plan import Sequence
from headspace.engine.view import engine_view
from headspace.errors import HostPagesRefused, UserError
from headspace.kv.transfer import sm_count
from headspace.model.llama import LlamaModel
from headspace.planner.plan import Plan
from headspace.planner.profile import Profile

# CUDA stream priorities (lower is first): the offload lane's decode steps, then the resident
# lane's steps, then the offload lane's prefill pieces
PRIORITIES = {"offload decode": -2, "resident": -1, "offload prefill": 0}
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
        self.worker = self._priority_stream = None  # (the latter a GPU's resident lane's)
        if self.shared:
            self.worker = LaneWorker(self.offload, PRIORITIES["offload prefill"],
                                     PRIORITIES["offload decode"],
                                     _prefill_sms(config.runtime))  # fmt: skip
        if self.shared and config.runtime.on_gpu:
            self._priority_stream = torch.cuda.Stream(config.runtime.device,
                                                      priority=PRIORITIES["resident"])  # fmt: skip
        if self.worker is not None:  # its thread stops with the lanes, or at exit
            weakref.finalize(self, self.worker.close)
        # what the whole arena holds: every request is checked against it
        self.whole = parts.planner(LaneMemory(self.arena_bytes, self.host_bytes),
                                   self.resident.runner.budget)  # fmt: skip
        self.split = None  # the arena's split beside an offload lane
        if self.shared:
            self.split = ArenaSplit(self.resident, self.offload, self.worker, self.whole, parts,
                                    config)  # fmt: skip
        self._next_id = 0
        self._lane_of: dict[int, Lane] = {}  # every request not returned finished, by id
        self._aborted: list[RequestOutput] = []  # of requests never handed to a lane

    @contextlib.contextmanager
    def given_at_once(self, at_once: bool = True):
        """Within it, the requests added come as one batch (``at_once``: ``generate``'s or a
        lone stream's, the step budget for throughput and no resident reserve) or one by
        one (a server's: for the running requests' pace); one by one again after it."""
        self._given(at_once)
        try:
            yield
        finally:
            self._given(False)

    def _given(self, at_once: bool) -> None:
        step, piece = self.parts.step_tokens(at_once), self.parts.step_tokens(at_once, slices=False)

        def set_budget(lane: Lane) -> None:
            lane.scheduler.step_tokens, lane.scheduler.piece_tokens = step, piece
            lane.scheduler.paced = not at_once

        set_budget(self.resident)
        if self.worker is not None:
            self.worker.submit(set_budget)
            self.split.given_at_once(at_once)

    # -- requests ------------------------------------------------------------------------
    def check(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """The sequence a request would be; UserError, with the numbers, for a prompt past
        the context or one that no plan of the whole arena can hold."""
        self.check_length(len(prompt_ids), params.max_new_tokens)
        max_tokens = min(len(prompt_ids) + params.max_new_tokens, self.max_context)
        seq = Sequence(self._next_id, list(prompt_ids), max_tokens)
        seq.reuse_prefix = params.prompt_logprobs is None  # (each position's logits needed)
        self.whole.plan([seq])  # refuses, with the numbers, what no plan can hold
        return seq

    def check_length(self, num_tokens: int, new_tokens: int) -> None:
        """Refuse an empty prompt or one past the context. A prompt of the whole context
        takes one new token at most (its last position predicts it, and no K/V is kept for
        it: how a harness scores a whole window), so it is refused ``new_tokens`` past 1."""
        if num_tokens == 0:
            raise UserError("the prompt is empty")
        if num_tokens > self.max_context:
            raise UserError(
                f"the prompt has {num_tokens} tokens, which does not fit the context of "
                f"{self.max_context} tokens (raise it explicitly with max_context / --max-context)"
            )
        if num_tokens == self.max_context and new_tokens > 1:
            raise UserError(
                f"the prompt has {num_tokens} tokens, the whole context, which leaves room for "
                f"one new token, not {new_tokens} (raise the context explicitly with "
                f"max_context / --max-context)",
                "max_new_tokens",
            )

    def add(self, prompt_ids: list[int], params: SamplingParams,
            prompt: str | list[int] | None = None) -> int:  # fmt: skip
        """Queue a request (token ids) in its lane; returns its id. Refuses, with the
        numbers, a prompt that no plan can hold."""
        seq = self.check(prompt_ids, params)
        self._next_id += 1
        streamer = StopStringStreamer(self.tokenizer, params.stop, params.min_tokens)
        generator = make_generator(params, self.resident.runner.device)
        request = Request(seq, params, generator, streamer, time.perf_counter(),
                          prompt_ids if prompt is None else prompt)  # fmt: skip
        if self._offloads(self.spec.pages_for(seq.max_tokens)):
            self._lane_of[seq.seq_id] = self.offload
            self.split.add(request)
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
        self.split.ended(request_id)
        waiting = self.split.take_waiting(request_id)
        if waiting is not None:
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
            if self.split is not None:
                self.split.clear()
            self._aborted.clear()
            self._lane_of.clear()

    def has_unfinished(self) -> bool:
        """Whether a request is waiting, running, has tokens on their way, an ended one is
        still to be returned, or the arena is still split for an offload lane that ended."""
        busy = self.worker is not None and not self.worker.done
        split = self.split is not None and self.split.open
        return bool(self._lane_of or self._aborted) or busy or split or \
            self.resident.has_unfinished()  # fmt: skip

    def has_running(self) -> bool:
        return bool(self._lane_of) or self.resident.has_running()

    def has_requests(self) -> bool:
        """Whether a request added is neither ended nor aborted."""
        return bool(self._lane_of)

    def prefilling(self) -> int | None:
        """The request whose prompt is being prefilled on the engine's thread, else the
        offload lane's (None between prompts)."""
        found = self.resident.prefilling()
        return found if found is not None or self.offload is None else self.offload.prefilling()

    def offloads(self, num_tokens: int) -> bool:
        """Whether a request that may reach ``num_tokens`` tokens runs in the offload lane."""
        return self._offloads(self.spec.pages_for(num_tokens))

    def _offloads(self, pages: int) -> bool:
        """Whether a request that may reach ``pages`` pages runs in the offload lane (more
        than the whole arena holds resident)."""
        return self.split is not None and pages > self.split.full_pages

    # -- steps ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step of the resident lane (after the split changes it), and what the offload
        lane has produced since the last step; when only the offload lane has work, waits a
        while for it."""
        split = self.split
        if split is not None:
            split.place()
            split.make_room()
        outputs, self._aborted = self._aborted, []
        if self.resident.has_unfinished():
            with self._resident_stream():
                outputs += self.resident.step()
        if split is not None and split.opening is not None and \
                not self.resident.scheduler.has_work_due:  # fmt: skip
            split.open_offload()
        if self.worker is not None:
            outputs += self.worker.take()
            if not outputs and not self.resident.holds_pages() and not self.worker.idle:
                self.worker.wait(OFFLOAD_WAIT_S)  # (nothing else runs: no spinning)
                outputs += self.worker.take()
        for output in outputs:
            if output.finished:
                self._lane_of.pop(output.request_id, None)
                if split is not None:
                    split.ended(output.request_id)
        if split is not None and split.open and not outputs:  # (the arena back at once)
            split.place()
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
        split = self.split
        shown = self.offload if split and split.open and self.offload.runner.plan else self.resident
        queued = list(split.waiting) + split.in_transit() if split is not None else []
        runtime = self.config.runtime
        return engine_view(lanes, queued, shown,
                           runtime.device if runtime.on_gpu else None)  # fmt: skip

    def logits(self, token_ids: list[int], decode_tokens: int = 0) -> torch.Tensor:
        """fp32 logits ``[len(token_ids), vocab]`` (CPU) through the paged prefill path; the
        last ``decode_tokens`` rows come from decode steps fed the given tokens (teacher
        forcing), so they run what generation runs (the hybrid tier, its sparse mode).
        Nothing may run: the lane that holds the tokens takes the whole arena."""
        self.check_length(len(token_ids), 0)
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
        if self._offloads(pages):
            lane = self.offload  # run here, on this thread: its worker is idle
            self.split.take_whole()
        elif self.split is not None and self.split.open:
            self.split.close_offload()
        try:
            lane.scheduler.laid_out(lane.runner.prepare(lane.scheduler.layout_for(seqs)))
        except HostPagesRefused as refused:  # (the pools follow what the arena holds)
            lane.scheduler.layout_refused(refused.num_pages)
            raise
        return lane.runner.plan, lane

    def reset_peaks(self) -> None:
        """Start each lane's peak of GPU pages over (nothing runs: the offload lane's
        thread is idle)."""
        for lane in (self.resident, self.offload):
            if lane is not None:
                lane.peak_pages = 0

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


def _prefill_sms(runtime) -> int | None:
    """The SMs the offload lane's prompt pieces run on beside decoding requests (None: all,
    or no GPU)."""
    if not runtime.on_gpu or runtime.prefill_sm_share >= 1:
        return None
    return confined_sms(sm_count(torch.device(runtime.device)), runtime.prefill_sm_share)


__all__ = ["Lanes"]

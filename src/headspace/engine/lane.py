"""A lane: requests that share one layout of a part of the KV arena, their scheduler, the
runner over that part, and each request's record from its admission to its end.

Each ``step`` asks the scheduler for a :class:`StepPlan`, hands it to the runner (a new
layout first, when one is due, then the step's page copies), launches the step's compute (one
decode step of every running request, a piece of the prompt being prefilled) and reads the
tokens of the step before: step n+1 is queued before the host reads the tokens of step n
(stop strings, detokenising and scheduling overlap the GPU). A long prompt is prefilled in
pieces between the decode steps of the others.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from headspace.engine.config import EngineConfig
from headspace.engine.forcing import forced_logits
from headspace.engine.logits_process import process, record, start_history
from headspace.engine.outputs import FINISH_REASONS, GenerationStats, RequestOutput
from headspace.engine.paged_runner import PagedRunner
from headspace.engine.ranks import Ranks
from headspace.engine.requests import (
    Request,
    TokenRead,
    advance,
    logprob_rows,
    prompt_logprobs,
    read_logprob,
    start_read,
)
from headspace.engine.sampling import finite_rows, sample
from headspace.engine.scheduler import Scheduler
from headspace.engine.step_plan import PrefillPiece, Sequence, StepPlan
from headspace.errors import HostPagesRefused
from headspace.kv.spec import KVSpec
from headspace.parallel.dist import broadcast_

PROGRESS_MIN_TOKENS = 4096  # show a prefill progress bar from this prompt length on
log = logging.getLogger("headspace.engine")
NON_FINITE = -1  # a read token that says its row's logits were not finite


def _picked(tokens: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """``tokens [rows]`` (the picks in their slots) as the host reads them: ``NON_FINITE``
    where a row's logits were not finite. A fresh tensor: the slot keeps a token of the
    vocabulary, which the step launched next reads."""
    return tokens.masked_fill(~finite, NON_FINITE)


@dataclass(frozen=True)
class LaneContext:
    """What every lane of an engine shares: the engine's options, the page shape, the
    end-of-sequence ids, its ranks under torchrun (sampled tokens are rank 0's) and a
    test's ``logits_filter`` and ``lane_step`` (:class:`~headspace.engine.hooks.EngineHooks`)."""

    config: EngineConfig
    spec: KVSpec
    eos_token_ids: frozenset[int]
    ranks: Ranks | None = None
    logits_filter: Callable | None = None
    lane_step: Callable[[str], None] | None = None


class Lane:
    """One lane's requests over its ``scheduler`` and ``runner`` (named ``name``)."""

    def __init__(self, name: str, scheduler: Scheduler, runner: PagedRunner,
                 context: LaneContext):  # fmt: skip
        self.name, self.scheduler, self.runner, self.context = name, scheduler, runner, context
        self.last_step: StepPlan | None = None  # the step plan run last (an engine view's)
        self._hidden = None  # a chunk's states between layer slices
        self.peak_pages = 0
        self.steps = 0  # steps that ran compute (decode, a prefill piece or both)
        self.prefilled_tokens = 0.0  # prompt tokens computed so far (a layer slice: its part)
        self._by_id: dict[int, Request] = {}  # the requests not finished or aborted
        self._reads: deque[TokenRead] = deque()
        self._bars: dict[int, tqdm] = {}  # the prefill progress of the prompt being computed
        self._ended: list[RequestOutput] = []  # ended between reads, returned next step

    # -- requests ------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue ``request``; it joins the lane's running batch at a coming step."""
        self._by_id[request.seq.seq_id] = request  # known before it is queued
        self.scheduler.add(request.seq)

    def requests(self) -> list[Request]:
        """The requests the lane holds (waiting, running, swapped out), in no order."""
        return list(self._by_id.values())

    def abort(self, request_id: int) -> bool:
        """Drop a request wherever it is (waiting, prefilling, decoding, swapped out): its
        GPU and host pages return to their pools now, and the next step returns it with
        ``finish_reason`` "abort". False if it is unknown or done."""
        request = self._by_id.get(request_id)
        if request is None:
            return False
        if request.seq is self.scheduler.prefilling:  # a chunk part-way through its layers
            self._hidden = None
        self.scheduler.abort(request.seq)
        self._end(request, "aborted")
        return True

    def _end(self, request: Request, why: str) -> None:
        """``request`` ended outside a token's read (``why``: FINISH_REASONS' key), its
        pages already back: the next step returns it."""
        del self._by_id[request.seq.seq_id]
        bar = self._bars.pop(request.seq.seq_id, None)
        if bar is not None:
            bar.close()
        request.ended, request.finished = why, time.perf_counter()
        request.new_text = ""
        self._ended.append(self._output(request, final=True))

    def abort_all(self) -> None:
        """Abort every request and forget them (an error or a closed loop left the batch:
        every page goes back, nothing is returned)."""
        try:
            for request_id in list(self._by_id):
                self.abort(request_id)
        finally:
            self._reads.clear()
            self._ended.clear()

    def prefilling(self) -> int | None:
        """The request whose prompt is being prefilled (None between prompts)."""
        seq = self.scheduler.prefilling
        return None if seq is None else seq.seq_id

    def has_unfinished(self) -> bool:
        """Whether a request is waiting, running, has tokens on their way or an ended one
        is still to be returned, or the scheduler has a change due."""
        return self.has_running() or bool(self._ended) or self.scheduler.has_work

    def has_running(self) -> bool:
        """Whether a request is waiting or running, or has tokens on their way."""
        return bool(self._by_id) or bool(self._reads)

    def holds_pages(self) -> bool:
        """Whether a sequence holds pages or a step's tokens are still on their way."""
        return not self.scheduler.idle or bool(self._reads)

    def step(self) -> list[RequestOutput]:
        """Run one step: launch the next piece of work (a new layout, swaps, the decode step
        of the running requests, a piece of a prompt's prefill) and read every step's tokens
        but this one's (at most one step is in flight while the host reads). Returns the
        requests that advanced (finished and aborted ones marked)."""
        if self.context.lane_step is not None:
            self.context.lane_step(self.name)
        outputs, self._ended = self._ended, []
        before = len(self._reads)
        self._launch()
        in_flight = 1 if len(self._reads) > before else 0  # this step's read, if it made one
        advanced: dict[int, Request] = {}
        while len(self._reads) > in_flight:
            for request in self._resolve(self._reads.popleft()):
                advanced[request.seq.seq_id] = request
        return outputs + [self._output(request, final=request.seq.finish_reason is not None)
                          for request in advanced.values()]  # fmt: skip

    # -- one step ------------------------------------------------------------------------
    def _launch(self) -> None:
        """Run the scheduler's next step plan (after the layout it asks for, when one is
        due: that plan carries nothing else)."""
        plan = self.scheduler.schedule()
        while plan.layout is not None:  # (a new part first, then the queue's)
            try:
                self.scheduler.laid_out(self.runner.prepare(plan))
            except HostPagesRefused as refused:  # the first request it was for ends alone
                seq = self.scheduler.layout_refused(refused.num_pages)
                log.warning("%s; the first request it was laid out for ends", refused)
                if seq is not None:
                    self._end(self._by_id[seq.seq_id], "no pages")
            plan = self.scheduler.schedule()
        self.last_step = plan
        self._run(plan)

    def _run(self, plan: StepPlan) -> None:
        """Execute ``plan``: its changes on the runner, then its compute; sampled tokens
        start their way to the host."""
        self._prepare(plan)
        for seq in plan.ended:  # no page for it: none free, no host page to swap it out to
            log.warning("request %d ended: no free KV page, and no host page to swap it out "
                        "to (--host-memory)", seq.seq_id)  # fmt: skip
            self._end(self._by_id[seq.seq_id], "no pages")
        if plan.admitted is not None:
            self._admitted(plan.admitted)
        sampled: list[tuple[list[Sequence], torch.Tensor]] = []  # (sequences, their tokens)
        logprobs: dict[int, torch.Tensor] = {}  # seq id -> its token's logprob row
        hidden = None  # a mixed step's piece, computed with the decode rows
        if plan.decode:
            batch = plan.decode
            positions = [s.num_scheduled - 1 for s in batch]
            seq_ids, slots = [s.seq_id for s in batch], [s.slot for s in batch]
            if plan.mixed and not self.runner.runs_mixed(plan.prefill, plan.decode_pages):
                plan.mixes = False  # (no graph takes it: two forwards, the decode's a graph)
            if plan.mixed:
                hidden, (logits, slots) = self.runner.mixed(plan.prefill, seq_ids, positions,
                                                            slots, plan.decode_pages)  # fmt: skip
            else:
                logits, slots = self.runner.decode(seq_ids, positions, slots, plan.decode_pages)
            finite = self._sample(batch, logits, logprobs)
            sampled.append((batch, _picked(self.runner.tokens.index_select(0, slots), finite)))
            pool = self.scheduler.blocks.pool
            self.peak_pages = max(self.peak_pages, pool.num_pages - pool.num_free)
        if plan.prefill is not None:
            piece = plan.prefill
            span = (piece.layers[1] - piece.layers[0]) / piece.num_layers  # (a layer slice's part)
            self.prefilled_tokens += (piece.end - piece.start) * span
            first = self._prefill(piece, logprobs, hidden)
            if first is not None:
                sampled.append(first)
        self.steps += bool(plan.decode) or plan.prefill is not None
        if sampled:  # one read a step: the decode batch's tokens and a first token together
            seqs = [seq for batch, _ in sampled for seq in batch]
            self._reads.append(start_read(seqs, torch.cat([t for _, t in sampled]), logprobs))

    def _prepare(self, plan: StepPlan) -> None:
        """The runner makes ``plan``'s changes; where the host pages it grows cannot be had
        (page-locking refused), the sequences on those pages end alone and the runner
        makes the rest of the plan."""
        try:
            self.runner.prepare(plan)
        except HostPagesRefused as refused:
            log.warning("%s; the requests on those pages end, the others go on", refused)
            piece = plan.prefill
            self.scheduler.host_refused(refused.num_pages, plan)
            if piece is not None and plan.prefill is None:  # its sequence ended
                self._hidden = None
            self.runner.prepare(plan)

    def _admitted(self, seq: Sequence) -> None:
        """A request whose prefill begins: the tiers it runs on, its progress bar."""
        request = self._by_id[seq.seq_id]
        head_map = self.runner.plan.head_map
        request.lane = self.name
        request.num_gpu_heads = head_map.count("gpu")
        request.num_streamed_heads = head_map.count("stream")
        request.num_hybrid_heads = head_map.count("hybrid")
        if request.num_hybrid_heads:
            request.cpu_share = self.runner.cpu_share
        if request.params.logprobs is not None and request.logprobs is None:
            request.logprobs = []
        if request.history is None:  # (once: a prompt computed again keeps its counts)
            vocab = self.runner.model.config.vocab_size
            request.history = start_history(request.params, seq.prompt_ids,
                                            self.context.eos_token_ids, vocab,
                                            self.runner.device)  # fmt: skip
        total = len(seq.prompt_ids) - seq.num_cached
        show = self.context.config.runtime.progress and total >= PROGRESS_MIN_TOKENS
        self._bars[seq.seq_id] = tqdm(total=total, desc="prefill", unit="tok", disable=not show,
                                      leave=False)  # fmt: skip

    def _prefill(self, piece: PrefillPiece, logprobs: dict[int, torch.Tensor],
                 hidden: torch.Tensor | None = None
                 ) -> tuple[list[Sequence], torch.Tensor] | None:  # fmt: skip
        """One piece of a prompt (``hidden``: its states, computed in a mixed step); after
        its last, its sequence and first token (on the device; its logprob row into
        ``logprobs`` where asked for)."""
        seq = piece.seq
        carried = self._hidden if piece.layers[0] > 0 else None  # the slice before's states
        if hidden is None:
            hidden = self.runner.prefill_chunk(seq, piece.start, piece.end, piece.pages,
                                               piece.recurs, piece.layers, carried)  # fmt: skip
        self._hidden = None if piece.through else hidden
        if not piece.through:
            return None
        request = self._by_id[seq.seq_id]
        if request.params.prompt_logprobs is not None:
            request.prompt_logprobs = (request.prompt_logprobs or [None]) + prompt_logprobs(
                self.runner.model, hidden, seq.prompt_ids, piece.start,
                request.params.prompt_logprobs)  # fmt: skip
        bar = self._bars[seq.seq_id]
        bar.update(piece.end - piece.start)
        if not piece.last:
            return None
        bar.close()
        del self._bars[seq.seq_id]
        self.scheduler.blocks.cache_full_pages(seq.seq_id, seq.prompt_ids)
        logits = self.runner.end_prefill(seq, hidden, seq.slot)
        finite = self._sample([seq], logits[None], logprobs)
        return [seq], _picked(self.runner.tokens[seq.slot : seq.slot + 1], finite)

    def _sample(self, batch: list[Sequence], logits: torch.Tensor,
                logprobs: dict[int, torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """Sampled rows overwrite the greedy pick in their slot (on the device, no sync);
        under torchrun every rank takes rank 0's tokens; the rows whose requests ask for
        log probabilities put them in ``logprobs``. Returns whether each row's ``logits
        [rows, vocab]`` were finite (bool ``[rows]``, on the device)."""
        if self.context.logits_filter is not None:
            logits = self.context.logits_filter([seq.prompt_ids for seq in batch], logits)
        finite, sampled, counted = finite_rows(logits), False, []  # (before any -inf mask)
        for row, seq in enumerate(batch):
            request = self._by_id[seq.seq_id]
            params, history = request.params, request.history
            if params.temperature == 0 and history is None:
                continue  # (the step's own greedy pick stands)
            row_logits = logits[row]
            if history is not None:
                generated = seq.num_scheduled - len(seq.prompt_ids)  # (in flight included)
                row_logits = process(row_logits, params, history, generated)
                counted.append((history, seq.slot))
            self.runner.tokens[seq.slot] = sample(row_logits, params, request.generator)
            sampled = True
        if sampled and self.context.ranks is not None:
            broadcast_(self.runner.tokens)
        for history, slot in counted:  # (rank 0's tokens, under torchrun)
            record(history, self.runner.tokens[slot])
        self._logprobs(batch, logits, logprobs)
        return finite

    def _logprobs(self, batch: list[Sequence], logits: torch.Tensor,
                  logprobs: dict[int, torch.Tensor]) -> None:  # fmt: skip
        """The rows of ``batch`` whose requests ask for log probabilities: their tokens'
        (the picks in their slots), computed together, into ``logprobs`` by sequence id."""
        asking = [(row, seq) for row, seq in enumerate(batch)
                  if self._by_id[seq.seq_id].params.logprobs is not None]  # fmt: skip
        if not asking:
            return
        top = max(self._by_id[seq.seq_id].params.logprobs for _, seq in asking)
        rows = torch.tensor([row for row, _ in asking], device=logits.device)
        slots = torch.tensor([seq.slot for _, seq in asking], device=logits.device)
        found = logprob_rows(logits.index_select(0, rows), self.runner.tokens[slots], top)
        logprobs.update((seq.seq_id, found[i]) for i, (_, seq) in enumerate(asking))

    def _resolve(self, read: TokenRead) -> list[Request]:
        """Take the read tokens into their requests; the requests that advanced."""
        if read.ready is not None:
            read.ready.synchronize()
        advanced = []
        for seq_id, token in zip(read.seq_ids, read.tokens.tolist(), strict=True):
            request = self._by_id.get(seq_id)
            if request is None:  # launched before its end (or its abort) was known
                continue
            request.seq.num_pending -= 1
            if seq_id in read.logprobs and token != NON_FINITE:
                row, top = read.logprobs[seq_id], request.params.logprobs
                request.logprobs.append(read_logprob(token, row, top))
            request.new_text += self._accept(request, token)
            advanced.append(request)
            if request.seq.finish_reason:
                del self._by_id[seq_id]
        return advanced

    def _accept(self, request: Request, token: int) -> str:
        """Append one read token; finish the request when done; return new text. A
        ``NON_FINITE`` token ends this request alone ("error"); the others go on."""
        seq = request.seq
        piece, reason = "", None
        if token == NON_FINITE:
            request.ended = "non-finite logits"
            reason = FINISH_REASONS[request.ended]
        else:
            if not seq.output_ids:
                request.first_token = time.perf_counter()
            seq.output_ids.append(token)
            piece, reason = advance(request, token, self.context.eos_token_ids)
        blocks = self.scheduler.blocks
        if reason:
            if blocks.per_entry:  # (bytes held, share of the full KV)
                held, full = blocks.held(seq.seq_id)
                request.kv_held = held * self.context.spec.entry_token_bytes, held / max(full, 1)
            self.scheduler.finish(seq, reason)
            request.finished = time.perf_counter()
            piece += request.streamer.finish()
        elif blocks.has_pages_to_cache(seq.seq_id, seq.num_tokens):
            blocks.cache_full_pages(seq.seq_id, seq.token_ids)  # once per page
        return piece

    def _output(self, request: Request, final: bool) -> RequestOutput:
        """The request as it stands; ``final``: with its whole stats (it has ended)."""
        return request.output(self._final_stats if final else None)

    def _final_stats(self, request: Request, stats: GenerationStats) -> None:
        seq = request.seq
        stats.decode_seconds = request.finished - (request.first_token or request.finished)
        stats.cpu_kept_fraction = self.runner.kept_summary(seq.seq_id)
        if stats.cpu_share is not None and self.runner.cpu_share is not None:
            stats.cpu_share = self.runner.cpu_share  # where the share's search left it
        self.runner.forget(seq.seq_id)
        if request.kv_held is not None:
            stats.kv_held_bytes, stats.kv_held_fraction = request.kv_held
        runtime = self.context.config.runtime
        if runtime.on_gpu:
            stats.peak_gpu_bytes = torch.cuda.max_memory_allocated(runtime.device)
            stats.peak_reserved_bytes = torch.cuda.max_memory_reserved(runtime.device)

    def score(self, seq: Sequence, token_ids: list[int], chunk: int) -> torch.Tensor:
        """fp32 logits ``[len(token_ids), vocab]`` (CPU) of ``seq``'s prompt (the first tokens
        of ``token_ids``) through the paged prefill path, the rest through decode steps fed
        the given tokens (:func:`forced_logits`); the lane is laid out for it alone."""
        scheduler = self.scheduler
        return forced_logits(self.runner, scheduler.blocks, scheduler.tiers, seq, token_ids,
                             chunk)  # fmt: skip


__all__ = ["Lane", "LaneContext", "NON_FINITE"]

"""The stepping core: requests come and go between steps over one scheduler.

``add_request`` queues a prompt; each ``step`` launches the next GPU work (a swap-in, one
decode step of every running request, a piece of the prompt being prefilled) and reads the
tokens of the step before, so step n+1 is queued before the host reads the tokens of step n
(stop strings, detokenising and scheduling overlap the GPU). A long prompt is prefilled in
pieces between the decode steps of the others. Each time nothing holds pages, the planner
lays the KV arena out for the requests next in line (``BatchPlanner.replan``).
"""

from __future__ import annotations

import time
from collections import deque

import torch
from tqdm import tqdm

from headspace.engine.batch_plan import BatchPlanner
from headspace.engine.config import EngineConfig
from headspace.engine.detokenize import StopStringStreamer
from headspace.engine.forcing import forced_logits
from headspace.engine.hooks import EngineHooks
from headspace.engine.memory import (
    attention_prefix,
    kv_arena_bytes,
    prefill_chunk_size,
    rank_host_bytes,
)
from headspace.engine.outputs import EngineLoad, GenerationStats, RequestOutput
from headspace.engine.paged_runner import PagedRunner
from headspace.engine.ranks import Ranks
from headspace.engine.requests import Request, TokenRead, start_read
from headspace.engine.sampling import SamplingParams, finite_rows, make_generator, sample
from headspace.engine.scheduler import PrefillPiece, Scheduler, Sequence, StepPlan
from headspace.engine.weight_stream import device_weight_bytes, streamed_weight_bytes
from headspace.errors import UserError
from headspace.kv.block_table import GPU, HOST
from headspace.kv.entry_table import block_manager
from headspace.kv.host_store import HostKVArena
from headspace.kv.spec import KVSpec
from headspace.model.llama import LlamaModel, SliceStates
from headspace.parallel.dist import all_agree, broadcast_, host_min
from headspace.planner.plan import Plan
from headspace.planner.profile import Profile
from headspace.tiers.hybrid_blocks import box_bytes_per_kv_byte

PROGRESS_MIN_TOKENS = 4096  # show a prefill progress bar from this prompt length on
NON_FINITE = -1  # a read token that says its row's logits were not finite


def _picked(tokens: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """``tokens [rows]`` (the picks in their slots) as the host reads them: ``NON_FINITE``
    where a row's logits were not finite. A fresh tensor: the slot keeps a token of the
    vocabulary, which the step launched next reads."""
    return tokens.masked_fill(~finite, NON_FINITE)


class BatchGenerator:
    """Generates for many prompts at once over the tiers of the current plan."""

    def __init__(self, model: LlamaModel, tokenizer, config: EngineConfig,
                 eos_token_ids: set[int], max_context: int, profile: Profile | None = None,
                 ranks: Ranks | None = None, hooks: EngineHooks | None = None):  # fmt: skip
        hooks = hooks or EngineHooks()
        self.logits_filter = hooks.logits_filter
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.eos_token_ids, self.max_context, self.ranks = eos_token_ids, max_context, ranks
        cfg, dtype = model.config, config.runtime.torch_dtype
        self.spec = KVSpec.of(cfg, config.cache.page_size, dtype.itemsize)
        self.weight_bytes = weights = device_weight_bytes(model)  # on the device
        streamed = streamed_weight_bytes(model)
        self.chunk = prefill_chunk_size(cfg, config, weights, max_context, streamed > 0)
        if ranks is not None:  # the same chunks on every rank (their collectives pair up)
            self.chunk = host_min(self.chunk)
        arena = kv_arena_bytes(cfg, config, self.spec, weights, self.chunk, max_context)
        if ranks is not None:  # the same pages on every rank
            self.spec, arena = ranks.pages(self.spec, arena)
        # (the machine's budget, divided between its ranks, the same on every rank)
        host_bytes = rank_host_bytes(config.cache.host_memory, ranks.on_host if ranks else 1)
        on_gpu = config.runtime.on_gpu
        if config.cache.host_memory is None and not on_gpu:  # the arena is host memory too
            host_bytes = max(host_bytes - arena, 0)
        if config.offload.cpu_sparsity is not None and config.offload.cpu_query_blocks:
            # the sparse mode's key boxes, beside the host pages they bound
            host_bytes = int(host_bytes / (1 + box_bytes_per_kv_byte(dtype.itemsize)))
        if ranks is not None:
            host_bytes = host_min(host_bytes)
        host = (hooks.host_arena or HostKVArena)(self.spec, dtype, pin=on_gpu,
                                                 budget=host_bytes)  # fmt: skip
        layout = ranks.layout if ranks else None
        num_entries = None  # shared pages; else every (layer, kv head) of the rank in its own
        if config.budgets.per_head_pages:
            num_entries = self.spec.num_entries if layout is None else sum(layout.layer_heads)
        blocks = block_manager(self.spec.page_size, num_entries)  # the scheduler's
        self.runner = PagedRunner(model, config, self.spec, arena, host, blocks,
                                  2 * config.runtime.max_batch, max_context, profile, layout,
                                  hooks.graphs, hooks.prefix_piece, hooks.cpu_timings,
                                  hooks.step_clock, hooks.prompt_stand_in)  # fmt: skip
        self.planner = BatchPlanner(model.config, config, self.spec, self.runner, blocks,
                                    weights, self.chunk, streamed, ranks,
                                    hooks.hardware)  # fmt: skip
        own_pools = ranks is not None and config.budgets.per_head_pages  # pages per rank
        self.scheduler = Scheduler(blocks, config.runtime.max_batch, 2 * config.runtime.max_batch,
                                   config.cache.prefix_caching, all_agree if own_pools else bool,
                                   self.chunk, self._step_tokens(False), cfg.num_layers,
                                   attention_prefix(cfg),
                                   self._step_tokens(False, slices=False))  # fmt: skip
        self._hidden: SliceStates | None = None  # a chunk's states between layer slices
        self._next_id = 0
        self.peak_pages = 0
        self._by_id: dict[int, Request] = {}  # the requests not finished or aborted
        self._reads: deque[TokenRead] = deque()
        self._bars: dict[int, tqdm] = {}  # the prefill progress of the prompt being computed
        self._aborted: list[RequestOutput] = []  # aborted requests, returned by the next step

    def _step_tokens(self, at_once: bool, slices: bool = True) -> int:
        """The prompt work a step carries while others decode (a whole chunk when none
        does), in whole pages."""
        page = self.spec.page_size
        return max(page, self.config.runtime.step_tokens(at_once, slices) // page * page)

    def given_at_once(self, at_once: bool) -> None:
        """Whether the requests now added come as one batch (``generate``: the step budget
        for throughput) or one by one (a server: for the running requests' pace)."""
        self.scheduler.step_tokens = self._step_tokens(at_once)
        self.scheduler.piece_tokens = self._step_tokens(at_once, slices=False)

    # -- planning ------------------------------------------------------------------------
    def plan(self, seqs: list[Sequence]) -> Plan:
        """The plan for ``seqs`` running together (UserError with the numbers if none)."""
        return self.planner.plan(seqs)

    def prepare(self, seqs: list[Sequence]) -> Plan:
        """Plan and lay out for ``seqs`` alone (nothing may hold pages); returns the plan."""
        if self.has_running():
            raise UserError("requests are running: the layout cannot change under them")
        plan = self.plan(seqs)
        self.planner.apply(plan)
        return plan

    # -- requests ------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    prompt: str | list[int] | None = None) -> int:  # fmt: skip
        """Queue a request (token ids); it joins the running batch at a coming step. Returns
        its id. Refuses, with the numbers, a prompt that no plan can hold."""
        seq = self.check(prompt_ids, params)
        self._next_id += 1
        streamer = StopStringStreamer(self.tokenizer, params.stop)
        generator = make_generator(params, self.runner.device)
        request = Request(seq, params, generator, streamer, time.perf_counter(),
                           prompt_ids if prompt is None else prompt)  # fmt: skip
        self._by_id[seq.seq_id] = request  # known before it is queued (abort_all finds it)
        self.scheduler.add(seq)
        return seq.seq_id

    def check(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """The sequence a request would be; UserError, with the numbers, for a prompt past
        the context or one that no plan can hold."""
        self._check_length(len(prompt_ids), room_for_one=True)
        max_tokens = min(len(prompt_ids) + params.max_new_tokens, self.max_context)
        seq = Sequence(self._next_id, list(prompt_ids), max_tokens)
        self.plan([seq])  # refuses, with the numbers, what no plan can hold
        return seq

    def load(self) -> EngineLoad:
        """Requests by state, pages in use, the head map's entries by tier, swaps so far."""
        scheduler, plan = self.scheduler, self.runner.plan
        pools = scheduler.blocks.pools
        used = {tier: pool.num_pages - pool.num_free for tier, pool in pools.items()}
        entries = {t: plan.head_map.count(t) if plan else 0 for t in ("gpu", "stream", "hybrid")}
        runtime = self.config.runtime
        reserved = torch.cuda.max_memory_reserved(runtime.device) if runtime.on_gpu else 0
        return EngineLoad(running=len(scheduler.running), waiting=len(scheduler.waiting),
                          swapped=len(scheduler.swapped), gpu_pages_used=used[GPU],
                          host_pages_used=used[HOST], resident_entries=entries["gpu"],
                          streamed_entries=entries["stream"], hybrid_entries=entries["hybrid"],
                          num_swaps=scheduler.num_swaps, peak_reserved_bytes=reserved)  # fmt: skip

    def abort(self, request_id: int) -> bool:
        """Drop a request wherever it is (waiting, prefilling, decoding, swapped out): its
        GPU and host pages return to their pools now, and the next step returns it with
        ``finish_reason`` "abort". False if it is unknown or done."""
        request = self._by_id.pop(request_id, None)
        if request is None:
            return False
        seq = request.seq
        bar = self._bars.pop(seq.seq_id, None)
        if bar is not None:
            bar.close()
        if seq is self.scheduler.prefilling:  # a chunk part-way through its layers goes too
            self._hidden = None
        self.scheduler.abort(seq)
        request.ended, request.finished = "aborted", time.perf_counter()
        request.new_text = ""
        self._aborted.append(self._output(request, final=True))
        return True

    def abort_all(self) -> None:
        """Abort every request and forget them (an error or a closed loop left the batch:
        every page goes back, nothing is returned)."""
        try:
            for request_id in list(self._by_id):
                self.abort(request_id)
        finally:
            self._reads.clear()
            self._aborted.clear()

    def prefilling(self) -> int | None:
        """The request whose prompt is being prefilled (None between prompts)."""
        seq = self.scheduler.prefilling
        return None if seq is None else seq.seq_id

    def has_unfinished(self) -> bool:
        """Whether a request is waiting, running, has tokens on their way or an aborted one
        is still to be returned."""
        return self.has_running() or bool(self._aborted)

    def has_running(self) -> bool:
        """Whether a request is waiting or running, or has tokens on their way."""
        return bool(self._by_id) or bool(self._reads)

    def step(self) -> list[RequestOutput]:
        """Run one step: launch the next piece of GPU work (swap-in, decode step of the
        running requests, a piece of a prompt's prefill) and read every step's tokens but
        this one's (at most one step is in flight while the host reads). Returns the
        requests that advanced (finished and aborted ones marked)."""
        outputs, self._aborted = self._aborted, []
        before = len(self._reads)
        self._launch()
        in_flight = 1 if len(self._reads) > before else 0  # this step's read, if it made one
        advanced: dict[int, Request] = {}
        while len(self._reads) > in_flight:
            for request in self._resolve(self._reads.popleft()):
                advanced[request.seq.seq_id] = request
        return outputs + [self._output(request, final=request.seq.finish_reason is not None)
                          for request in advanced.values()]  # fmt: skip

    def _check_length(self, num_tokens: int, room_for_one: bool) -> None:
        """Refuse an empty prompt or one past the context (with ``room_for_one``, a prompt
        must leave room for a generated token)."""
        if num_tokens == 0:
            raise UserError("the prompt is empty")
        if num_tokens + room_for_one > self.max_context:
            raise UserError(
                f"the prompt has {num_tokens} tokens, which does not fit the context of "
                f"{self.max_context} tokens (raise it explicitly with max_context / --max-context)"
            )

    # -- one step ------------------------------------------------------------------------
    def _launch(self) -> None:
        """Queue the next GPU work the scheduler plans (a new layout first, when nothing
        holds pages)."""
        scheduler = self.scheduler
        if scheduler.idle and scheduler.waiting:
            self.planner.replan(scheduler)
        else:  # the running ones may move for one that cannot fit, or back once it ends
            self.planner.relayout(scheduler)
        self._run(scheduler.schedule(self.planner.worth_joining(scheduler)))

    def _run(self, plan: StepPlan) -> None:
        """Execute ``plan`` on the runner, in its order; sampled tokens start their way to
        the host."""
        self.runner.swap(plan.swap_in, to_host=False)
        if plan.admitted is not None:
            self._admitted(plan.admitted)
        self.runner.swap(plan.swap_out, to_host=True)
        sampled: list[tuple[list[Sequence], torch.Tensor]] = []  # (sequences, their tokens)
        if plan.decode:
            batch = plan.decode
            positions = [s.num_scheduled - 1 for s in batch]
            seq_ids, slots = [s.seq_id for s in batch], [s.slot for s in batch]
            logits, slots = self.runner.decode(seq_ids, positions, slots, plan.decode_pages)
            finite = self._sample(batch, logits)
            sampled.append((batch, _picked(self.runner.tokens.index_select(0, slots), finite)))
            pool = self.scheduler.blocks.pool
            self.peak_pages = max(self.peak_pages, pool.num_pages - pool.num_free)
        if plan.prefill is not None:
            first = self._prefill(plan.prefill)
            if first is not None:
                sampled.append(first)
        if sampled:  # one read a step: the decode batch's tokens and a first token together
            seqs = [seq for batch, _ in sampled for seq in batch]
            self._reads.append(start_read(seqs, torch.cat([t for _, t in sampled])))

    def _admitted(self, seq: Sequence) -> None:
        """A request whose prefill begins: the tiers it runs on, its progress bar."""
        request = self._by_id[seq.seq_id]
        head_map = self.runner.plan.head_map
        request.num_gpu_heads = head_map.count("gpu")
        request.num_streamed_heads = head_map.count("stream")
        request.num_hybrid_heads = head_map.count("hybrid")
        if request.num_hybrid_heads:
            request.cpu_share = self.runner.cpu_share
        total = len(seq.prompt_ids) - seq.num_cached
        show = self.config.runtime.progress and total >= PROGRESS_MIN_TOKENS
        self._bars[seq.seq_id] = tqdm(total=total, desc="prefill", unit="tok", disable=not show,
                                      leave=False)  # fmt: skip

    def _prefill(self, piece: PrefillPiece) -> tuple[list[Sequence], torch.Tensor] | None:
        """One piece of a prompt; after its last, its sequence and first token (on the
        device)."""
        seq = piece.seq
        carried = self._hidden if piece.layers[0] > 0 else None  # the slice before's states
        hidden = self.runner.prefill_chunk(seq, piece.start, piece.end, piece.pages, piece.recurs,
                                           piece.layers, carried)  # fmt: skip
        self._hidden = None if piece.through else hidden
        if not piece.through:
            return None
        bar = self._bars[seq.seq_id]
        bar.update(piece.end - piece.start)
        if not piece.last:
            return None
        bar.close()
        del self._bars[seq.seq_id]
        self.scheduler.blocks.cache_full_pages(seq.seq_id, seq.prompt_ids)
        logits = self.runner.end_prefill(seq, hidden, seq.slot)
        finite = self._sample([seq], logits[None])
        return [seq], _picked(self.runner.tokens[seq.slot : seq.slot + 1], finite)

    def _sample(self, batch: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Sampled rows overwrite the greedy pick in their slot (on the device, no sync);
        under torchrun every rank takes rank 0's tokens. Returns whether each row's
        ``logits [rows, vocab]`` were finite (bool ``[rows]``, on the device)."""
        if self.logits_filter is not None:
            logits = self.logits_filter([seq.prompt_ids for seq in batch], logits)
        sampled = False
        for row, seq in enumerate(batch):
            request = self._by_id[seq.seq_id]
            if request.params.temperature > 0:
                token = sample(logits[row], request.params, request.generator)
                self.runner.tokens[seq.slot], sampled = token, True
        if sampled and self.ranks is not None:
            broadcast_(self.runner.tokens)
        return finite_rows(logits)

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
            reason, request.ended = "error", "non-finite logits"
        else:
            if not seq.output_ids:
                request.first_token = time.perf_counter()
            seq.output_ids.append(token)
            piece, reason = self._advance(request, token)
        if reason:
            if self.config.budgets.per_head_pages:  # (bytes held, share of the full KV)
                held, full = self.scheduler.blocks.held(seq.seq_id)
                request.kv_held = held * self.spec.entry_token_bytes, held / max(full, 1)
            self.scheduler.finish(seq, reason)
            request.finished = time.perf_counter()
            piece += request.streamer.finish()
        elif self.scheduler.blocks.has_pages_to_cache(seq.seq_id, seq.num_tokens):
            self.scheduler.blocks.cache_full_pages(seq.seq_id, seq.token_ids)  # once per page
        return piece

    def _advance(self, request: Request, token: int) -> tuple[str, str | None]:
        """The new text of an appended ``token`` and why the request ends with it (None:
        it goes on); sets ``request.ended``."""
        seq, params = request.seq, request.params
        if token in self.eos_token_ids and not params.ignore_eos:
            request.ended = "end of sequence"
            return "", "stop"
        piece = request.streamer.update(seq.output_ids)
        if request.streamer.stopped:
            request.ended = "stop string"
            return piece, "stop"
        if seq.num_tokens >= seq.max_tokens:
            request.ended = "max_new_tokens" if len(seq.output_ids) >= params.max_new_tokens \
                else "context"  # fmt: skip
            return piece, "length"
        return piece, None

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
        runtime = self.config.runtime
        if runtime.on_gpu:
            stats.peak_gpu_bytes = torch.cuda.max_memory_allocated(runtime.device)
            stats.peak_reserved_bytes = torch.cuda.max_memory_reserved(runtime.device)

    def logits(self, token_ids: list[int], decode_tokens: int = 0) -> torch.Tensor:
        """fp32 logits ``[len(token_ids), vocab]`` (CPU) through the paged prefill path; the
        last ``decode_tokens`` rows come from decode steps fed the given tokens (teacher
        forcing), so they run what generation runs (the hybrid tier, its sparse mode)."""
        self._check_length(len(token_ids), room_for_one=False)
        if not 0 <= decode_tokens < len(token_ids):
            raise UserError(f"decode_tokens must be in [0, {len(token_ids) - 1}], got "
                            f"{decode_tokens}")  # fmt: skip
        seq = Sequence(self._next_id, list(token_ids[: len(token_ids) - decode_tokens]),
                       len(token_ids))  # fmt: skip
        self._next_id += 1
        self.prepare([seq])
        return forced_logits(self.runner, self.scheduler.blocks, self.planner.tiers, seq,
                             token_ids, self.chunk)  # fmt: skip

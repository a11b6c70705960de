"""Generation over the tiers: a plan per batch, continuous batching, pipelined decode.

Each time nothing holds pages, the planner lays the KV arena out for the sequences next in
line (``_replan``): all resident when they fit the GPU, else heads streamed from host pages
for as many of them as maximise the predicted throughput. A decode step reads its input
tokens from device slots, so step n+1 is launched before the host reads the tokens of step
n: the host's work (stop strings, detokenising, scheduling) overlaps the GPU's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tqdm import tqdm

from headspace.engine.batch_plan import BatchPlanner
from headspace.engine.config import EngineConfig
from headspace.engine.detokenize import StopStringStreamer
from headspace.engine.memory import host_budget, kv_arena_bytes, prefill_chunk_size
from headspace.engine.outputs import GenerationStats, RequestOutput
from headspace.engine.paged_runner import PagedRunner
from headspace.engine.ranks import Ranks
from headspace.engine.sampling import SamplingParams, make_generator, sample
from headspace.engine.scheduler import Scheduler, Sequence
from headspace.engine.weight_stream import device_weight_bytes, streamed_weight_bytes
from headspace.errors import UserError
from headspace.kv.block_table import GPU, HOST
from headspace.kv.host_store import HostKVArena
from headspace.kv.page_pool import OutOfPages
from headspace.model.llama import LlamaModel
from headspace.parallel.dist import all_agree, broadcast_, host_min
from headspace.planner.memory import KVSpec
from headspace.planner.plan import Plan
from headspace.planner.profile import Profile

PROGRESS_MIN_TOKENS = 4096  # show a prefill progress bar from this prompt length on


@dataclass
class _Request:
    seq: Sequence
    params: SamplingParams
    generator: torch.Generator | None
    streamer: StopStringStreamer
    submitted: float
    first_token: float = 0.0
    finished: float = 0.0
    num_gpu_heads: int = 0
    num_streamed_heads: int = 0
    num_hybrid_heads: int = 0
    kv_held: tuple[int, float] | None = None  # (bytes, share of the full KV) at its end


@dataclass
class _Read:
    """Tokens of one launched step on their way to the host."""

    seq_ids: list[int]
    tokens: torch.Tensor
    ready: torch.cuda.Event | None


class BatchGenerator:
    """Generates for many prompts at once over the tiers of the current plan."""

    def __init__(self, model: LlamaModel, tokenizer, config: EngineConfig,
                 eos_token_ids: set[int], max_context: int, profile: Profile | None = None,
                 ranks: Ranks | None = None):  # fmt: skip
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.eos_token_ids, self.max_context, self.ranks = eos_token_ids, max_context, ranks
        cfg, dtype = model.config, config.torch_dtype
        self.spec = KVSpec.of(cfg, config.page_size, dtype.itemsize)
        self.weight_bytes = weights = device_weight_bytes(model)  # on the device
        streamed = streamed_weight_bytes(model)
        self.chunk = prefill_chunk_size(cfg, config, weights, max_context, streamed > 0)
        if ranks is not None:  # the same chunks on every rank (their collectives pair up)
            self.chunk = host_min(self.chunk)
        arena = kv_arena_bytes(cfg, config, self.spec, weights, self.chunk, max_context)
        if ranks is not None:  # the same pages on every rank
            self.spec, arena = ranks.pages(self.spec, arena)
        host_bytes = host_budget(config.host_memory)
        if ranks is not None:  # the machine's budget, divided between its ranks
            host_bytes = ranks.host_bytes(host_bytes)
        host = HostKVArena(self.spec, dtype, pin=config.on_gpu, budget=host_bytes)
        self.runner = PagedRunner(model, config, self.spec, arena, host, 2 * config.max_batch,
                                  max_context, profile,
                                  ranks.layout if ranks else None)  # fmt: skip
        self.planner = BatchPlanner(model.config, config, self.spec, self.runner, weights,
                                    streamed, ranks)  # fmt: skip
        self._next_id = 0
        self.peak_pages = 0
        self._planned: set[int] | None = None  # the sequences entry staging is sized for

    # -- planning ------------------------------------------------------------------------
    def plan(self, seqs: list[Sequence]) -> Plan:
        """The plan for ``seqs`` running together (UserError with the numbers if none)."""
        return self.planner.plan(seqs)

    def _replan(self, scheduler: Scheduler) -> None:
        """Lay out for the sequences next in line: all resident if the first fits, else the
        streaming plan for the first k that maximises the predicted throughput."""
        queue = list(scheduler.waiting)[: self.config.max_batch]
        best, best_rate, planned = self.plan(queue[:1]), 0.0, queue[:1]
        if best.staging is not None or best.entry_staging:
            best_rate = self.planner.rate(best, planned)
            for k in range(2, len(queue) + 1):
                try:
                    plan = self.plan(queue[:k])
                except UserError:
                    break
                if (k_rate := self.planner.rate(plan, queue[:k])) < best_rate:
                    break
                best, best_rate, planned = plan, k_rate, queue[:k]
        # entries in host pages: the staging slots hold what was planned, no more
        self._planned = {s.seq_id for s in planned} if best.entry_staging else None
        self._apply(best, scheduler)

    def prepare(self, seqs: list[Sequence]) -> Plan:
        """Plan and lay out for ``seqs`` alone (nothing may hold pages); returns the plan."""
        plan = self.plan(seqs)
        self._apply(plan)
        return plan

    def _apply(self, plan: Plan, scheduler: Scheduler | None = None) -> None:
        self.runner.apply(plan)
        streams = plan.staging is not None
        self.tiers = ((GPU,) if plan.head_map.count("gpu") else ()) + ((HOST,) if streams else ())
        if self.config.per_head_pages:  # host pages are the entry table's, by entry
            self.tiers = (GPU,)
        if scheduler is not None:
            scheduler.tiers = self.tiers
            swaps = self.config.offload != "none" and not self.config.per_head_pages
            scheduler.optimistic = not streams and swaps
            scheduler.grow_host = self._grow_host

    def _grow_host(self, num_pages: int) -> str | None:
        """Grow the host pool to ``num_pages`` free pages; None when it did (under torchrun
        on every rank alike), else why not."""
        pool = self.runner.blocks.pools[HOST]
        try:
            self.runner.ensure_host_pages(pool.num_pages - pool.num_free + num_pages)
        except UserError as error:
            return str(error)
        return None

    def _worth_joining(self, scheduler: Scheduler):
        """While heads stream, a sequence joins the batch only if the predicted throughput
        does not drop (every byte of its history crosses PCIe each step)."""
        plan = self.runner.plan

        def accept(seq: Sequence) -> bool:
            running = scheduler.running
            if self._planned is not None:  # the staging slots hold what was planned
                return seq.seq_id in self._planned
            if plan.staging is None or not running:
                return True
            return self.planner.rate(plan, running + [seq]) >= self.planner.rate(plan, running)

        return accept

    # -- requests ------------------------------------------------------------------------
    def _submit(self, scheduler: Scheduler, ids: list[int], params: SamplingParams) -> _Request:
        self._check_length(len(ids), room_for_one=True)
        max_tokens = min(len(ids) + params.max_new_tokens, self.max_context)
        seq = Sequence(self._next_id, list(ids), max_tokens)
        self._next_id += 1
        self.plan([seq])  # refuses, with the numbers, what no plan can hold
        scheduler.add(seq)
        streamer = StopStringStreamer(self.tokenizer, params.stop)
        generator = make_generator(params, self.runner.device)
        return _Request(seq, params, generator, streamer, time.perf_counter())

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

    def _steps(self, prompts, params) -> Iterator[tuple[_Request, str]]:
        """Run the batch to the end; yield (request, new text) after every token."""
        own_pools = self.ranks is not None and self.config.per_head_pages  # pages per rank
        scheduler = Scheduler(self.runner.blocks, self.config.max_batch,
                              2 * self.config.max_batch, self.config.prefix_caching,
                              all_agree if own_pools else bool)  # fmt: skip
        requests = [self._submit(scheduler, ids, p) for ids, p in zip(prompts, params, strict=True)]
        self._requests, self._by_id = requests, {r.seq.seq_id: r for r in requests}
        reads: deque[_Read] = deque()
        try:
            while not scheduler.done or reads:
                launched = self._launch(scheduler, reads)
                if reads and (len(reads) > 1 or not launched):
                    yield from self._resolve(reads.popleft(), scheduler)
        finally:  # stopped early (an error, a stream left unread): the pages go back
            for seq_id in list(self.runner.blocks.tables):
                self.runner.blocks.free(seq_id)

    def _launch(self, scheduler: Scheduler, reads: deque[_Read]) -> bool:
        """Queue the next piece of GPU work (a swap-in, a prefill or a decode step)."""
        if scheduler.idle and scheduler.waiting:
            self._replan(scheduler)
        resumed = scheduler.resume()
        if resumed is not None:
            self.runner.swap(resumed[1], to_host=False)
        seq = scheduler.admit(self._worth_joining(scheduler))
        if seq is not None:
            request = self._by_id[seq.seq_id]
            request.num_gpu_heads = self.runner.plan.head_map.count("gpu")
            request.num_streamed_heads = self.runner.plan.head_map.count("stream")
            request.num_hybrid_heads = self.runner.plan.head_map.count("hybrid")
            logits = self._prefill(seq)
            self._sample([seq], logits[None])
            reads.append(self._read([seq], self.runner.tokens[seq.slot : seq.slot + 1].clone()))
            return True
        batch = [s for s in scheduler.running if s.num_scheduled < s.max_tokens]
        if not batch:
            return resumed is not None
        batch, pairs = scheduler.grow(batch)
        self.runner.swap(pairs, to_host=True)
        if not batch:
            return True
        positions = [s.num_scheduled - 1 for s in batch]
        logits, slots = self.runner.decode([s.seq_id for s in batch], positions,
                                           [s.slot for s in batch])  # fmt: skip
        self._sample(batch, logits)
        reads.append(self._read(batch, self.runner.tokens.index_select(0, slots)))
        pool = self.runner.blocks.pool
        self.peak_pages = max(self.peak_pages, pool.num_pages - pool.num_free)
        return True

    def _prefill(self, seq: Sequence) -> torch.Tensor:
        total = len(seq.prompt_ids) - seq.num_cached
        show = self.config.progress and total >= PROGRESS_MIN_TOKENS
        with tqdm(total=total, desc="prefill", unit="tok", disable=not show, leave=False) as bar:
            return self.runner.prefill(seq, self.chunk, on_chunk=bar.update, slot=seq.slot)

    def _sample(self, batch: list[Sequence], logits: torch.Tensor) -> None:
        """Sampled rows overwrite the greedy pick in their slot (on the device, no sync);
        under torchrun every rank takes rank 0's tokens."""
        sampled = False
        for row, seq in enumerate(batch):
            request = self._by_id[seq.seq_id]
            if request.params.temperature > 0:
                token = sample(logits[row], request.params, request.generator)
                self.runner.tokens[seq.slot], sampled = token, True
        if sampled and self.ranks is not None:
            broadcast_(self.runner.tokens)

    def _read(self, batch: list[Sequence], tokens: torch.Tensor) -> _Read:
        """Start copying ``tokens`` (a fresh tensor) of ``batch`` to the host; until they
        are read, each sequence has one more token pending."""
        for seq in batch:
            seq.num_pending += 1
        if not tokens.is_cuda:
            return _Read([s.seq_id for s in batch], tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return _Read([s.seq_id for s in batch], host, ready)

    def _resolve(self, read: _Read, scheduler: Scheduler) -> Iterator[tuple[_Request, str]]:
        if read.ready is not None:
            read.ready.synchronize()
        for seq_id, token in zip(read.seq_ids, read.tokens.tolist(), strict=True):
            request = self._by_id[seq_id]
            if request.seq.finish_reason:  # a step launched before its end was known
                continue
            request.seq.num_pending -= 1
            yield request, self._accept(scheduler, request, token)

    def _accept(self, scheduler: Scheduler, request: _Request, token: int) -> str:
        """Append one read token; finish the request when done; return new text."""
        seq, params = request.seq, request.params
        if not seq.output_ids:
            request.first_token = time.perf_counter()
        seq.output_ids.append(token)
        piece, reason = "", None
        if token in self.eos_token_ids and not params.ignore_eos:
            reason = "stop"
        else:
            piece = request.streamer.update(seq.output_ids)
            if request.streamer.stopped:
                reason = "stop"
            elif seq.num_tokens >= seq.max_tokens:
                reason = "length"
        if reason:
            request.kv_held = self.runner.kv_held(seq.seq_id)
            scheduler.finish(seq, reason)
            request.finished = time.perf_counter()
            piece += request.streamer.finish()
        elif self.runner.blocks.has_pages_to_cache(seq.seq_id, seq.num_tokens):
            self.runner.blocks.cache_full_pages(seq.seq_id, seq.token_ids)  # once per page
        return piece

    def _output(self, request: _Request) -> RequestOutput:
        seq = request.seq
        stats = GenerationStats(
            prompt_tokens=len(seq.prompt_ids), generated_tokens=len(seq.output_ids),
            prefill_seconds=request.first_token - request.submitted,
            decode_seconds=request.finished - request.first_token,
            num_gpu_heads=request.num_gpu_heads, num_streamed_heads=request.num_streamed_heads,
            num_hybrid_heads=request.num_hybrid_heads, num_swaps=seq.num_swaps,
            cpu_kept_fraction=self.runner.kept_summary(seq.seq_id),
        )  # fmt: skip
        if request.kv_held is not None:
            stats.kv_held_bytes, stats.kv_held_fraction = request.kv_held
        if self.config.on_gpu:
            stats.peak_gpu_bytes = torch.cuda.max_memory_allocated(self.config.device)
            stats.peak_reserved_bytes = torch.cuda.max_memory_reserved(self.config.device)
        return RequestOutput(seq.prompt_ids, request.streamer.text, seq.output_ids,
                             seq.finish_reason, stats, seq.num_cached)  # fmt: skip

    # -- entry points --------------------------------------------------------------------
    def run(self, prompts: list[list[int]], params: list[SamplingParams], on_finish=None):
        """RequestOutputs for ``prompts`` (token ids), in order; ``params`` per prompt.

        ``on_finish()`` is called each time a request completes (progress bars).
        """
        for request, _ in self._steps(prompts, params):
            if on_finish and request.seq.finish_reason:
                on_finish()
        return [self._output(r) for r in self._requests]

    def stream(self, prompt_ids: list[int], params: SamplingParams):
        """Yield the text of one request as it is produced; returns its RequestOutput."""
        for _, piece in self._steps([prompt_ids], [params]):
            if piece:
                yield piece
        return self._output(self._requests[0])

    def logits(self, token_ids: list[int], decode_tokens: int = 0) -> torch.Tensor:
        """fp32 logits ``[len(token_ids), vocab]`` (CPU) through the paged prefill path; the
        last ``decode_tokens`` rows come from decode steps fed the given tokens (teacher
        forcing), so they run what generation runs (the hybrid tier, its sparse mode)."""
        self._check_length(len(token_ids), room_for_one=False)
        if not 0 <= decode_tokens < len(token_ids):
            raise UserError(f"decode_tokens must be in [0, {len(token_ids) - 1}], got "
                            f"{decode_tokens}")  # fmt: skip
        num_prompt = len(token_ids) - decode_tokens
        seq = Sequence(self._next_id, list(token_ids[:num_prompt]), len(token_ids))
        self._next_id += 1
        self.prepare([seq])
        blocks = self.runner.blocks
        try:
            blocks.allocate_prompt(seq.seq_id, seq.prompt_ids, self.tiers, reuse=False)
        except OutOfPages:
            raise UserError(f"{len(token_ids)} tokens do not fit the KV pool") from None
        try:
            rows = [self.runner.prefill(seq, self.chunk, all_logits=True)]
            for position in range(num_prompt, len(token_ids)):
                blocks.append_token(seq.seq_id)
                self.runner.tokens[0] = token_ids[position]
                logits, _ = self.runner.decode([seq.seq_id], [position], [0])
                rows.append(logits.float().cpu())
            return torch.cat(rows)
        finally:
            blocks.free(seq.seq_id)

"""Generation over the page pool: continuous batching with prefix sharing, and streaming."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tqdm import tqdm

from headspace.engine.detokenize import StopStringStreamer
from headspace.engine.memory import num_kv_pages, offload_plan, prefill_chunk_size
from headspace.engine.paged_runner import PagedRunner
from headspace.engine.sampling import SamplingParams, make_generator, sample
from headspace.engine.scheduler import Scheduler, Sequence

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


class BatchGenerator:
    """Generates for many prompts at once; finished sequences make room for waiting ones."""

    def __init__(self, engine):
        config, model = engine.config, engine.model
        self.engine = engine
        self.max_batch = config.max_batch
        self._weight_bytes = sum(p.nbytes for p in model.parameters())
        self.plan = offload_plan(model.config, config, self._weight_bytes, engine.max_context)
        self.chunk = (self.plan.prefill_chunk if self.plan is not None
                      else prefill_chunk_size(model.config, config, self._weight_bytes,
                                              engine.max_context))  # fmt: skip
        if self.plan is not None:  # streamed heads: one sequence, a pool for its resident heads
            num_pages = -(-engine.max_context // config.page_size)
            self.runner = PagedRunner(model, config, num_pages, config.page_size,
                                      self.plan.head_map, self.plan.head_group)  # fmt: skip
            self.max_batch = 1
        else:
            self.runner = PagedRunner(model, config, self._pool_pages(), config.page_size)
        self._next_id = 0
        self.peak_pages = 0

    def _pool_pages(self) -> int:
        from headspace.planner.plan import working_bytes

        config, cfg = self.engine.config, self.engine.model.config
        return config.num_kv_pages or num_kv_pages(
            cfg, config.gpu_memory, device=torch.device(config.device),
            dtype=config.torch_dtype, page_size=config.page_size, weight_bytes=self._weight_bytes,
            activation_bytes=working_bytes(cfg, self.chunk, config.torch_dtype.itemsize),
            max_context=self.engine.max_context,
        )  # fmt: skip

    def _submit(self, scheduler: Scheduler, ids: list[int], params: SamplingParams) -> _Request:
        self.engine.check_length(len(ids))
        max_tokens = min(len(ids) + params.max_new_tokens, self.engine.max_context)
        seq = Sequence(self._next_id, list(ids), max_tokens)
        self._next_id += 1
        scheduler.add(seq)
        streamer = StopStringStreamer(self.engine.tokenizer, params.stop)
        generator = make_generator(params, self.runner.device)
        return _Request(seq, params, generator, streamer, time.perf_counter())

    def _steps(self, prompts, params) -> Iterator[tuple[_Request, str]]:
        """Run the batch to the end; yield (request, new text) after every token."""
        # Streamed heads keep one sequence's history in host memory: no cross-request reuse.
        prefix_caching = self.engine.config.prefix_caching and self.plan is None
        scheduler = Scheduler(self.runner.blocks, self.max_batch, prefix_caching)
        requests = [self._submit(scheduler, ids, p) for ids, p in zip(prompts, params, strict=True)]
        by_id = {r.seq.seq_id: r for r in requests}
        self._requests = requests
        while not scheduler.done:
            seq = scheduler.admit()
            if seq is not None:
                logits = self._prefill(seq)
                yield by_id[seq.seq_id], self._accept(scheduler, by_id[seq.seq_id], logits)
                continue
            batch = list(scheduler.running)
            logits = self.runner.decode(batch)
            pool = self.runner.blocks.pool
            self.peak_pages = max(self.peak_pages, pool.num_pages - pool.num_free)
            for seq, row in zip(batch, logits, strict=True):
                yield by_id[seq.seq_id], self._accept(scheduler, by_id[seq.seq_id], row)

    def _prefill(self, seq: Sequence) -> torch.Tensor:
        total = len(seq.prompt_ids) - seq.num_cached
        show = self.engine.config.progress and total >= PROGRESS_MIN_TOKENS
        with tqdm(total=total, desc="prefill", unit="tok", disable=not show, leave=False) as bar:
            return self.runner.prefill(seq, self.chunk, on_chunk=bar.update)

    def _accept(self, scheduler: Scheduler, request: _Request, logits: torch.Tensor) -> str:
        """Sample the next token of one request; finish it when done; return new text."""
        seq, params = request.seq, request.params
        token = int(sample(logits, params, request.generator).item())
        if not seq.output_ids:
            request.first_token = time.perf_counter()
        seq.output_ids.append(token)
        piece, reason = "", None
        if token in self.engine.eos_token_ids and not params.ignore_eos:
            reason = "stop"
        else:
            piece = request.streamer.update(seq.output_ids)
            if request.streamer.stopped:
                reason = "stop"
            elif seq.num_tokens >= seq.max_tokens:
                reason = "length"
        if reason:
            scheduler.finish(seq, reason)
            request.finished = time.perf_counter()
            piece += request.streamer.finish()
        return piece

    def _output(self, request: _Request):
        from headspace.engine.engine import GenerationStats, RequestOutput

        seq = request.seq
        stats = GenerationStats(
            prompt_tokens=len(seq.prompt_ids),
            generated_tokens=len(seq.output_ids),
            prefill_seconds=request.first_token - request.submitted,
            decode_seconds=request.finished - request.first_token,
        )
        return RequestOutput(seq.prompt_ids, request.streamer.text, seq.output_ids,
                             seq.finish_reason, stats, seq.num_cached)  # fmt: skip

    def run(self, prompts: list[list[int]], params: list[SamplingParams], on_finish=None):
        """RequestOutputs for ``prompts`` (token ids), in order; ``params`` per prompt.

        ``on_finish()`` is called each time a request completes (progress bars).
        """
        for request, _ in self._steps(prompts, params):
            if on_finish and request.finished and request.seq.finish_reason:
                on_finish()
        return [self._output(r) for r in self._requests]

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """fp32 logits ``[len(token_ids), vocab]`` (CPU) through the paged prefill path."""
        from headspace.errors import UserError
        from headspace.kv.page_pool import OutOfPages

        seq = Sequence(self._next_id, list(token_ids), len(token_ids))
        self._next_id += 1
        try:
            self.runner.blocks.allocate_prompt(seq.seq_id, seq.prompt_ids, reuse=False)
        except OutOfPages:
            raise UserError(f"{len(token_ids)} tokens do not fit the KV pool") from None
        try:
            return self.runner.prefill(seq, self.chunk, all_logits=True)
        finally:
            self.runner.blocks.free(seq.seq_id)

    def stream(self, prompt_ids: list[int], params: SamplingParams):
        """Yield the text of one request as it is produced; returns its RequestOutput."""
        for _, piece in self._steps([prompt_ids], [params]):
            if piece:
                yield piece
        return self._output(self._requests[0])

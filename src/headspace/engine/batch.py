"""Batched generation over the page pool: continuous batching with prefix sharing."""

from __future__ import annotations

import time

import torch

from headspace.engine.detokenize import StopStringStreamer
from headspace.engine.memory import num_kv_pages
from headspace.engine.paged_runner import PagedRunner
from headspace.engine.runner import ModelRunner
from headspace.engine.sampling import SamplingParams, make_generator, sample
from headspace.engine.scheduler import Scheduler, Sequence


class BatchGenerator:
    """Generates for many prompts at once; finished sequences make room for waiting ones."""

    def __init__(self, engine):
        config, model = engine.config, engine.model
        self.engine = engine
        self.chunk = ModelRunner(model, config).prefill_chunk_size()
        cfg = model.config
        activation_bytes = 2 * self.chunk * (6 * cfg.hidden_size + 3 * cfg.intermediate_size)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        num_pages = config.num_kv_pages or num_kv_pages(
            cfg, config.gpu_memory, device=torch.device(config.device),
            dtype=config.torch_dtype, page_size=config.page_size, weight_bytes=weight_bytes,
            activation_bytes=activation_bytes, max_context=engine.max_context,
        )  # fmt: skip
        self.runner = PagedRunner(model, config, num_pages, config.page_size)
        self._next_id = 0
        self.peak_pages = 0

    def run(self, prompts: list[list[int]], params: list[SamplingParams]):
        """RequestOutputs for ``prompts`` (token ids), in order; ``params`` per prompt."""
        from headspace.engine.engine import GenerationStats, RequestOutput

        scheduler = Scheduler(self.runner.blocks, self.engine.config.max_batch)
        states = {}
        for ids, p in zip(prompts, params, strict=True):
            self.engine.check_length(len(ids))
            max_tokens = min(len(ids) + p.max_new_tokens, self.engine.max_context)
            seq = Sequence(self._next_id, list(ids), max_tokens)
            self._next_id += 1
            scheduler.add(seq)
            device = self.runner.device
            states[seq.seq_id] = (seq, p, make_generator(p, device),
                                  StopStringStreamer(self.engine.tokenizer, p.stop))  # fmt: skip
        start = time.perf_counter()
        while not scheduler.done:
            seq = scheduler.admit()
            if seq is not None:
                self._accept(scheduler, states[seq.seq_id], self.runner.prefill(seq, self.chunk))
                continue
            batch = list(scheduler.running)
            logits = self.runner.decode(batch)
            self.peak_pages = max(self.peak_pages, self.runner.blocks.pool.num_pages
                                  - self.runner.blocks.pool.num_free)  # fmt: skip
            for seq, row in zip(batch, logits, strict=True):
                self._accept(scheduler, states[seq.seq_id], row)
        seconds = time.perf_counter() - start
        outputs = []
        for seq, _, _, streamer in states.values():
            streamer.finish()
            stats = GenerationStats(len(seq.prompt_ids), len(seq.output_ids), 0.0, seconds)
            outputs.append(RequestOutput(seq.prompt_ids, streamer.text, seq.output_ids,
                                         seq.finish_reason, stats, seq.num_cached))  # fmt: skip
        return outputs

    def _accept(self, scheduler: Scheduler, state, logits: torch.Tensor) -> None:
        """Sample the next token of one sequence and finish it when it is done."""
        seq, params, generator, streamer = state
        token = int(sample(logits, params, generator).item())
        seq.output_ids.append(token)
        if token in self.engine.eos_token_ids and not params.ignore_eos:
            scheduler.finish(seq, "stop")
            return
        streamer.update(seq.output_ids)
        if streamer.stopped:
            scheduler.finish(seq, "stop")
        elif seq.num_tokens >= seq.max_tokens:
            scheduler.finish(seq, "length")

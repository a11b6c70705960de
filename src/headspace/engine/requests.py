"""A request inside the stepping engine (its sequence, sampling, text so far, timings) and
the tokens of a launched step on their way to the host."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from headspace.engine.detokenize import StopStringStreamer
from headspace.engine.outputs import GenerationStats, RequestOutput
from headspace.engine.sampling import SamplingParams
from headspace.engine.step_plan import Sequence

FinalStats = Callable[["Request", GenerationStats], None]  # completes an ended one's stats


@dataclass
class Request:
    """One request: what the caller gave, how it is sampled, its timings (seconds of
    ``time.perf_counter``) and what has been returned of it."""

    seq: Sequence
    params: SamplingParams
    generator: torch.Generator | None
    streamer: StopStringStreamer
    submitted: float
    prompt: str | list[int]  # as the caller gave it
    first_token: float = 0.0
    finished: float = 0.0
    lane: str | None = None  # the lane it runs in, once admitted
    num_gpu_heads: int = 0
    num_streamed_heads: int = 0
    num_hybrid_heads: int = 0
    cpu_share: float | None = None  # of the hybrid heads' history before the GPU window
    kv_held: tuple[int, float] | None = None  # (bytes, share of the full KV) at its end
    ended: str | None = None  # why, in words (GenerationStats.ended)
    new_text: str = ""  # text of the step being read
    num_sent: int = 0  # output tokens returned by earlier steps

    def output(
        self, final_stats: Callable[[Request, GenerationStats], None] | None
    ) -> RequestOutput:
        """The request as it stands, with the tokens and text new since the last output;
        ``final_stats`` (it has ended) completes its stats."""
        seq = self.seq
        first = self.first_token or self.submitted  # (0 before its first token)
        stats = GenerationStats(
            prompt_tokens=len(seq.prompt_ids), generated_tokens=len(seq.output_ids),
            prefill_seconds=first - self.submitted, ended=self.ended,
            num_gpu_heads=self.num_gpu_heads, num_streamed_heads=self.num_streamed_heads,
            num_hybrid_heads=self.num_hybrid_heads, cpu_share=self.cpu_share,
            num_swaps=seq.num_swaps, lane=self.lane,
        )  # fmt: skip
        if final_stats is not None:
            final_stats(self, stats)
        elif self.first_token:  # so far
            stats.decode_seconds = time.perf_counter() - self.first_token
        new_ids = seq.output_ids[self.num_sent :]
        new_text, self.new_text = self.new_text, ""
        self.num_sent = len(seq.output_ids)
        return RequestOutput(self.prompt, self.streamer.text, list(seq.output_ids),
                             seq.finish_reason, stats, seq.num_cached, seq.seq_id,
                             new_text, new_ids)  # fmt: skip


@dataclass
class TokenRead:
    """Tokens of one launched step on their way to the host (``ready`` once copied)."""

    seq_ids: list[int]
    tokens: torch.Tensor  # [sequences]
    ready: torch.cuda.Event | None


def start_read(batch: list[Sequence], tokens: torch.Tensor) -> TokenRead:
    """Start copying ``tokens`` (a fresh tensor, one per sequence of ``batch``) to the host;
    until they are read, each sequence has one more token pending."""
    for seq in batch:
        seq.num_pending += 1
    if not tokens.is_cuda:
        return TokenRead([s.seq_id for s in batch], tokens, None)
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return TokenRead([s.seq_id for s in batch], host, ready)

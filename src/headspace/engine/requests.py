"""A request inside the stepping engine (its sequence, sampling, text so far, timings) and
the tokens of a launched step on their way to the host."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from headspace.engine.detokenize import StopStringStreamer
from headspace.engine.logits_process import TokenHistory
from headspace.engine.outputs import FINISH_REASONS, GenerationStats, RequestOutput, TokenLogprob
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
    history: TokenHistory | None = None  # its tokens on the device, where penalties need them
    logprobs: list[TokenLogprob] | None = None  # one per output token, where asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, asked for

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
        logprobs = new_logprobs = None
        if self.logprobs is not None:
            logprobs, new_logprobs = list(self.logprobs), self.logprobs[self.num_sent :]
        new_text, self.new_text = self.new_text, ""
        self.num_sent = len(seq.output_ids)
        return RequestOutput(self.prompt, self.streamer.text, list(seq.output_ids),
                             seq.finish_reason, stats, seq.num_cached, seq.seq_id,
                             new_text, new_ids, logprobs, new_logprobs,
                             self.prompt_logprobs)  # fmt: skip


@dataclass
class TokenRead:
    """Tokens of one launched step on their way to the host (``ready`` once copied), and
    the log probabilities of those whose requests ask for them."""

    seq_ids: list[int]
    tokens: torch.Tensor  # [sequences]
    ready: torch.cuda.Event | None
    logprobs: dict[int, torch.Tensor]  # seq id -> [1 + 2 * top] fp32 (``logprob_rows``' row)


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> torch.Tensor:
    """The log probability of each row's token (``tokens [rows]``) under fp32 ``logits
    [rows, vocab]``, then the ``top`` likeliest tokens' ids and log probabilities: ``[rows,
    1 + 2 * top]`` fp32 (ids below 2**24 are exact in fp32), on the logits' device (no
    sync)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    parts = [logprobs.gather(1, tokens.view(-1, 1))]
    if top:
        values, ids = logprobs.topk(top, dim=-1)
        parts += [ids.float(), values]
    return torch.cat(parts, dim=1)


def read_logprob(token: int, row: torch.Tensor, top: int) -> TokenLogprob:
    """A row of :func:`logprob_rows` as read on the host, its first ``top`` likeliest kept
    (a row computed for more)."""
    values = row.tolist()
    most = (len(values) - 1) // 2
    pairs = zip(values[1 : 1 + top], values[1 + most : 1 + most + top], strict=True)
    return TokenLogprob(token, values[0], tuple((int(i), v) for i, v in pairs))


PROMPT_LOGPROB_ROWS = 256  # prompt positions whose vocabulary logits exist at once


def prompt_logprobs(model, hidden: torch.Tensor, prompt_ids: list[int], start: int,
                    top: int) -> list[TokenLogprob]:  # fmt: skip
    """The log probability of each prompt token that positions ``start ..`` predict, from
    their last layer's ``hidden [tokens, hidden]`` (a prompt piece's), with the ``top``
    likeliest tokens' (read on the host: the piece waits for the device)."""
    found = []
    last = min(start + hidden.shape[0], len(prompt_ids) - 1)  # (the last predicts no prompt)
    for low in range(start, last, PROMPT_LOGPROB_ROWS):
        high = min(low + PROMPT_LOGPROB_ROWS, last)
        following = prompt_ids[low + 1 : high + 1]
        logits = model.logits(hidden[low - start : high - start])  # [rows, vocab] fp32
        rows = logprob_rows(logits, torch.tensor(following, device=logits.device), top).cpu()
        found += [read_logprob(t, row, top) for t, row in zip(following, rows, strict=True)]
    return found


def start_read(batch: list[Sequence], tokens: torch.Tensor,
               logprobs: dict[int, torch.Tensor] | None = None) -> TokenRead:  # fmt: skip
    """Start copying ``tokens`` (a fresh tensor, one per sequence of ``batch``) and the
    ``logprobs`` rows of some of them to the host; until they are read, each sequence has
    one more token pending."""
    for seq in batch:
        seq.num_pending += 1
    logprobs = logprobs or {}
    if not tokens.is_cuda:
        return TokenRead([s.seq_id for s in batch], tokens, None, logprobs)
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    rows = {}
    for seq_id, row in logprobs.items():
        rows[seq_id] = torch.empty(row.shape, dtype=row.dtype, pin_memory=True)
        rows[seq_id].copy_(row, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return TokenRead([s.seq_id for s in batch], host, ready, rows)


def advance(request: Request, token: int, eos_token_ids: frozenset[int]
            ) -> tuple[str, str | None]:  # fmt: skip
    """The new text of a ``token`` just appended to ``request``'s outputs and the finish
    reason it ends the request with (None: it goes on); sets ``request.ended``, the reason
    in detail (an end-of-sequence id of ``eos_token_ids``, a stop token or string, the
    tokens asked for or the context)."""
    seq, params = request.seq, request.params
    piece = ""
    if token in eos_token_ids and not params.ignore_eos:
        request.ended = "end of sequence"
    elif token in params.stop_token_ids:
        request.ended = "stop token"
    else:
        piece = request.streamer.update(seq.output_ids)
        if request.streamer.stopped:
            request.ended = "stop string"
        elif seq.num_tokens >= seq.max_tokens:
            request.ended = "max_new_tokens" if len(seq.output_ids) >= \
                params.max_new_tokens else "context"  # fmt: skip
    return piece, FINISH_REASONS.get(request.ended)

"""What a request's sampling parameters do to its logits before a token is picked:
repetition, presence and frequency penalties over the tokens so far, and ``min_tokens``
(the end-of-sequence and stop tokens masked until that many tokens are out).

Each request that asks for any keeps a :class:`TokenHistory` on the logits' device (its
output tokens counted there as they are picked, so no step waits for the host), and its
rows are picked outside the decode step's greedy pick: ``process`` then
:func:`~headspace.engine.sampling.sample` or argmax, then ``record``. Semantics as vLLM's
and OpenAI's: repetition penalty over the prompt and output tokens (a positive logit
divided by it, a negative one multiplied), presence and frequency penalties over the output
tokens (``logit - frequency * count - presence * (count > 0)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headspace.engine.sampling import SamplingParams


@dataclass
class TokenHistory:
    """A request's tokens so far, on the logits' device."""

    counts: torch.Tensor  # [vocab] float32: each token's count in the output so far
    in_prompt: torch.Tensor | None  # [vocab] bool (only under a repetition penalty)
    stops: torch.Tensor | None  # int64 ids masked before ``min_tokens`` (None: no mask)


def needs_history(params: SamplingParams) -> bool:
    """Whether ``params`` change the logits (a penalty, or ``min_tokens``)."""
    return (params.repetition_penalty != 1 or params.presence_penalty != 0
            or params.frequency_penalty != 0 or params.min_tokens > 0)  # fmt: skip


def start_history(params: SamplingParams, prompt_ids: list[int], eos_ids: frozenset[int],
                  vocab: int, device: torch.device) -> TokenHistory | None:  # fmt: skip
    """The history a request starts its output with (None when its parameters need none);
    ``eos_ids``: the model's end-of-sequence tokens (masked too before ``min_tokens``,
    unless it ignores them)."""
    if not needs_history(params):
        return None
    in_prompt = None
    if params.repetition_penalty != 1:
        in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        ids = torch.tensor([t for t in prompt_ids if 0 <= t < vocab], dtype=torch.long)
        in_prompt[ids.to(device)] = True
    stops = None
    if params.min_tokens > 0:
        ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        ids = sorted(t for t in ids if 0 <= t < vocab)
        stops = torch.tensor(ids, dtype=torch.long, device=device) if ids else None
    counts = torch.zeros(vocab, dtype=torch.float32, device=device)
    return TokenHistory(counts, in_prompt, stops)


def process(logits: torch.Tensor, params: SamplingParams, history: TokenHistory,
            generated: int) -> torch.Tensor:  # fmt: skip
    """``logits [vocab]`` (fp32) as ``params`` make them for the next token, ``generated``
    tokens being out already; a new tensor (no host sync)."""
    counts = history.counts
    if params.repetition_penalty != 1:
        seen = history.in_prompt | (counts > 0)
        penalty = params.repetition_penalty
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    if params.frequency_penalty or params.presence_penalty:
        logits = logits - params.frequency_penalty * counts
        logits = logits - params.presence_penalty * (counts > 0).float()
    if history.stops is not None and generated < params.min_tokens:
        logits = logits.index_fill(0, history.stops, float("-inf"))
    return logits


def record(history: TokenHistory, token: torch.Tensor) -> None:
    """Count ``token`` (0-d int64, on the device) in the output."""
    history.counts.index_add_(0, token.view(1), torch.ones(1, device=history.counts.device))


__all__ = ["TokenHistory", "needs_history", "process", "record", "start_history"]

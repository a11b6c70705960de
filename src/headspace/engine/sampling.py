"""Sampling parameters and token selection (greedy, temperature, top-k, top-p, seeded)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from headspace.errors import UserError

REPETITION_PENALTY = (0.01, 100.0)  # the range a repetition penalty may take
MOST_LOGPROBS = 20  # likeliest tokens a request may ask the log probabilities of (OpenAI's)


def as_float32(value: float) -> float:
    """``value`` as the sampler's float32 arithmetic holds it (what a float64 becomes)."""
    return torch.tensor(value, dtype=torch.float32).item()


@dataclass
class SamplingParams:
    """How to pick tokens. ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` are off.
    ``stop_token_ids``: tokens that end the request as the end-of-sequence token does (the
    token is kept in ``token_ids``, not in the text; ``ignore_eos`` leaves them in force).
    ``repetition_penalty`` (1: off; over the prompt and output tokens), ``presence_penalty``
    and ``frequency_penalty`` (0: off; over the output tokens), ``min_tokens`` (the
    end-of-sequence and stop tokens cannot come before that many tokens): as vLLM's
    (:mod:`headspace.engine.logits_process`). ``logprobs``: each generated token's log
    probability under the model (before temperature and penalties) and the ``logprobs``
    likeliest tokens' (None: none; at most ``MOST_LOGPROBS``). ``prompt_logprobs``: the same
    for each prompt token after the first (its prompt then skips the prefix cache)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be a positive integer, got "
                            f"{self.max_new_tokens}", "max_new_tokens")  # fmt: skip
        if not 0 <= self.temperature < float("inf"):
            raise UserError(f"temperature must be >= 0 and finite, got {self.temperature}",
                            "temperature")  # fmt: skip
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        for name in ("temperature", "top_p"):  # as the sampler sees them: float32
            value = getattr(self, name)
            if value > 0 and as_float32(value) == 0:
                raise UserError(f"{name}={value:.3g} rounds to 0 in float32, the sampler's "
                                "precision (the smallest float32 above 0 is 1.4e-45)",
                                name)  # fmt: skip
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"top_k must be a non-negative integer, got {self.top_k}", "top_k")
        if any(not s for s in self.stop):
            raise UserError("stop strings must be non-empty", "stop")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise UserError(f"stop_token_ids must be non-negative integers, got "
                            f"{self.stop_token_ids}", "stop_token_ids")  # fmt: skip
        self._check_penalties()
        for name in ("logprobs", "prompt_logprobs"):
            top = getattr(self, name)
            if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                                    or not 0 <= top <= MOST_LOGPROBS):  # fmt: skip
                raise UserError(f"{name} must be an integer in [0, {MOST_LOGPROBS}], got {top}",
                                name)  # fmt: skip

    def _check_penalties(self) -> None:
        penalty = self.repetition_penalty  # (within it, fp32 logits stay finite)
        if not REPETITION_PENALTY[0] <= penalty <= REPETITION_PENALTY[1]:
            raise UserError(f"repetition_penalty must be in [{REPETITION_PENALTY[0]}, "
                            f"{REPETITION_PENALTY[1]}], got {penalty}",
                            "repetition_penalty")  # fmt: skip
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise UserError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise UserError(f"min_tokens must be an integer from 0 to the new tokens asked "
                            f"for ({self.max_new_tokens}), got {self.min_tokens}",
                            "min_tokens")  # fmt: skip


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A seeded generator on ``device`` when sampling with a seed, else None."""
    if params.temperature == 0 or params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """Pick the next token from fp32 ``logits [vocab]``; returns a 0-d int64 tensor. Never
    raises on the values (no host sync either): the likeliest token always stays a
    candidate, and a row without finite logits picks among all tokens (the caller finds
    such rows with :func:`finite_rows` and ends their requests)."""
    if params.temperature == 0:
        return logits.argmax()
    logits = (logits - logits.max()) / params.temperature  # the likeliest at 0: no overflow
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p  # keep the crossing token
        drop[0] = False  # and the likeliest, whatever top_p rounds to
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    usable = torch.isfinite(probs).all() & (probs.sum() > 0)  # (on the device: no sync)
    probs = torch.where(usable, probs, torch.ones_like(probs))
    return torch.multinomial(probs, 1, generator=generator)[0]


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """Whether each row of ``logits [rows, vocab]`` is finite throughout: bool ``[rows]``
    (on the logits' device; no sync)."""
    return torch.isfinite(logits).all(dim=-1)

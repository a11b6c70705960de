"""Sampling parameters and token selection (greedy, temperature, top-k, top-p, seeded)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from headspace.errors import UserError


@dataclass
class SamplingParams:
    """How to pick tokens. ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` are off."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"top_k must be a non-negative integer, got {self.top_k}")
        if any(not s for s in self.stop):
            raise UserError("stop strings must be non-empty")


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
    """Pick the next token from fp32 ``logits [vocab]``; returns a 0-d int64 tensor."""
    if params.temperature == 0:
        return logits.argmax()
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p  # keep the crossing token
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[0]

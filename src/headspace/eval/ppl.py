"""Perplexity with a sliding window through ``llm.logits`` (the engine's prefill path, or its
decode steps for the last tokens of each window)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def sliding_window_nll(
    logits_fn: Callable[[list[int]], torch.Tensor],
    token_ids: list[int],
    context: int,
    stride: int | None = None,
    on_window: Callable[[], None] | None = None,
    score_last: int | None = None,
) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) and the number of tokens scored.

    Windows of ``context`` tokens advance by ``stride`` (default: half a window); each token
    is scored once, in the first window that reaches it, with up to ``context - stride``
    tokens of history (the scheme of transformers' perplexity guide). With ``score_last``,
    windows advance by it and only each window's last ``score_last`` tokens are scored (the
    first window's earlier tokens are history only): decode-step perplexity, where
    ``logits_fn`` computes those predictions by decode steps.
    """
    stride = score_last or stride or context // 2
    total, count, scored_until = 0.0, 0, 1
    for start in range(0, max(len(token_ids) - 1, 1), stride):
        window = token_ids[start : start + context]
        if len(window) < 2:
            break
        logits = logits_fn(window)  # [len(window), vocab]
        first = max(scored_until - start, 1)  # positions in the window still unscored
        if score_last:
            first = max(first, len(window) - score_last)
        targets = torch.tensor(window[first:])
        log_probs = torch.log_softmax(logits[first - 1 : len(window) - 1].float(), dim=-1)
        total -= log_probs.gather(1, targets[:, None]).sum().item()
        count += len(targets)
        scored_until = start + len(window)
        if on_window:
            on_window()
        if start + context >= len(token_ids):
            break
    return total, count


def perplexity(logits_fn, token_ids: list[int], context: int, stride: int | None = None,
               score_last: int | None = None) -> float:  # fmt: skip
    nll, count = sliding_window_nll(logits_fn, token_ids, context, stride,
                                    score_last=score_last)  # fmt: skip
    return math.exp(nll / count)

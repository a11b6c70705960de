"""Observation-window scores (SnapKV): how much the last queries of a prompt attend each
earlier token, per kv head; what every budget policy ranks tokens by."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from headspace.budgets.spec import POOL


def observation_scores(
    q_window: torch.Tensor,  # [heads, window, dim]: the prompt's last queries (rotated)
    k: torch.Tensor,  # [kv_heads, tokens, dim]: every key of the prompt, window included
    *,
    pool: int = POOL,
    scale: float | None = None,
) -> torch.Tensor:
    """Scores ``[kv_heads, tokens - window]`` of the tokens before the window: each window
    query's softmax weight of the token (causal inside the window), summed over the window's
    queries, averaged over the query heads of a kv head, then max-pooled over ``pool``
    neighbouring tokens. fp32; weights of a row sum to at most ``window``."""
    num_heads, window, dim = q_window.shape
    num_kv_heads, num_tokens, _ = k.shape
    group = num_heads // num_kv_heads
    scale = dim**-0.5 if scale is None else scale
    positions = torch.arange(num_tokens, device=k.device)
    q_positions = torch.arange(num_tokens - window, num_tokens, device=k.device)
    future = positions[None, :] > q_positions[:, None]  # [window, tokens]
    scores = k.new_empty(num_kv_heads, num_tokens - window, dtype=torch.float32)
    for h in range(num_kv_heads):  # one kv head at a time: fp32 [group, window, tokens]
        q = q_window[h * group : (h + 1) * group].float()
        logits = torch.matmul(q, k[h].float().T) * scale
        weights = torch.softmax(logits.masked_fill_(future, float("-inf")), dim=-1)
        scores[h] = weights[..., : num_tokens - window].sum(1).mean(0)
    if pool > 1 and scores.shape[-1]:
        scores = F.max_pool1d(scores[:, None], pool, stride=1, padding=pool // 2)[:, 0]
    return scores

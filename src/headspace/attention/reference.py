"""Eager fp32 reference attention: the ground truth every backend is tested against."""

from __future__ import annotations

import torch


def reference_attention(
    q: torch.Tensor,  # [heads, q_tokens, dim]
    k: torch.Tensor,  # [kv_heads, kv_tokens, dim]
    v: torch.Tensor,  # [kv_heads, kv_tokens, dim]
    *,
    causal: bool = False,
    scale: float | None = None,
    mask: torch.Tensor | None = None,  # [heads, q_tokens, kv_tokens] bool: pairs allowed
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in fp32 with grouped kv heads.

    ``causal`` aligns the queries to the end of the keys (query ``i`` sees keys
    ``j <= i + kv_tokens - q_tokens``), the layout of a prefill chunk appended to a prefix;
    ``mask`` (a sparse pattern's, for instance) restricts the pairs further.
    Returns ``out [heads, q_tokens, dim]`` in q's dtype and the natural-log
    ``lse [heads, q_tokens]`` in fp32; rows with no visible key give out 0 and lse -inf.
    """
    num_heads, num_q, dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // k.shape[0]
    scale = dim**-0.5 if scale is None else scale
    k32 = k.float().repeat_interleave(group, dim=0)
    v32 = v.float().repeat_interleave(group, dim=0)
    scores = torch.matmul(q.float(), k32.transpose(1, 2)) * scale  # [heads, q, kv]
    if causal:
        q_pos = torch.arange(num_q, device=q.device)[:, None] + (num_kv - num_q)
        visible = torch.arange(num_kv, device=q.device)[None, :] <= q_pos
        scores = scores.masked_fill(~visible, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [heads, q]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return torch.matmul(probs, v32).to(q.dtype), lse

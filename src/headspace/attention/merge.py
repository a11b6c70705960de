"""Exact merge of partial attention states by log-sum-exp."""

from __future__ import annotations

import torch


def merge_attention(
    outs: list[torch.Tensor], lses: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over disjoint key sets into attention over their union.

    ``outs[i]`` is ``[heads, tokens, dim]`` and ``lses[i]`` its fp32 ``[heads, tokens]``
    natural-log normaliser (-inf where part ``i`` saw no key). Returns ``(out, lse)``
    with out in the dtype of ``outs[0]``; rows empty in every part give 0 and -inf.
    """
    assert outs and len(outs) == len(lses)
    if len(outs) == 1:
        return outs[0], lses[0]
    lse_stack = torch.stack([lse.float() for lse in lses])  # [parts, heads, tokens]
    lse = torch.logsumexp(lse_stack, dim=0)
    weights = torch.exp(lse_stack - lse).nan_to_num(0.0)  # [parts, heads, tokens]
    out = sum(w[..., None] * o.float() for w, o in zip(weights, outs, strict=True))
    return out.to(outs[0].dtype), lse

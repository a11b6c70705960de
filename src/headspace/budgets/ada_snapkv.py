"""Ada-SnapKV (Ada-KV applied to SnapKV): a layer's budget is shared by its heads, which
compete for it by score; each head is first guaranteed a floor share of an even split."""

from __future__ import annotations

import torch

FLOOR = 0.2  # share of an even split each head keeps whatever its scores (Ada-KV's alpha)


def allocate(scores: list[torch.Tensor], selectable: int, *, floor: float = FLOOR,
             **_) -> list[torch.Tensor]:  # fmt: skip
    """Tokens each kv head selects ``[kv_heads]`` per layer (on the scores' device): a layer
    selects ``kv_heads x selectable`` in all; each head first its top ``floor x
    selectable``, then the layer's highest remaining scores, whichever head they belong to."""
    counts = []
    for layer_scores in scores:
        num_heads, num_tokens = layer_scores.shape
        total = min(num_heads * selectable, num_heads * num_tokens)
        base = min(int(floor * selectable), num_tokens)
        order = layer_scores.argsort(dim=1, descending=True)
        rest = layer_scores.gather(1, order[:, base:])  # each head's scores after its floor
        extra = min(total - num_heads * base, rest.numel())
        chosen = rest.flatten().topk(extra).indices // max(rest.shape[1], 1)
        count = torch.full((num_heads,), base, dtype=torch.long, device=layer_scores.device)
        count += torch.bincount(chosen, minlength=num_heads)
        counts.append(count)
    return counts

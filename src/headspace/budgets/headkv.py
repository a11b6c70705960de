"""HeadKV: the budget of the whole model is divided across layers and heads by each head's
importance, measured beforehand on the model (a profile's retrieval scores); within a head,
tokens are chosen as SnapKV chooses them."""

from __future__ import annotations

import torch

FLOOR = 0.2  # share of an even split every head keeps, however unimportant


def allocate(scores: list[torch.Tensor], selectable: int, *,
             head_scores: torch.Tensor | None = None, floor: float = FLOOR,
             **_) -> list[torch.Tensor]:  # fmt: skip
    """Tokens each kv head selects ``[kv_heads]`` per layer: ``floor x selectable`` each,
    and the rest of ``layers x kv_heads x selectable`` in proportion to ``head_scores
    [layers, kv_heads]`` (non-negative; a head keeps at most what it has)."""
    if head_scores is None:
        raise ValueError("headkv needs head scores from a profile (--profile FILE)")
    num_layers, num_heads = len(scores), scores[0].shape[0]
    if tuple(head_scores.shape) != (num_layers, num_heads) or (head_scores < 0).any():
        raise ValueError(f"head scores must be non-negative [{num_layers}, {num_heads}], got "
                         f"{tuple(head_scores.shape)}")  # fmt: skip
    base = int(floor * selectable)
    pool = num_layers * num_heads * (selectable - base)
    weights = head_scores.double().flatten()
    weights = (
        weights / weights.sum() if weights.sum() > 0 else torch.full_like(weights, 1 / len(weights))
    )
    shares = torch.floor(weights * pool).long()
    shares[weights.argsort(descending=True)[: pool - int(shares.sum())]] += 1  # what rounding left
    counts = (base + shares).view(num_layers, num_heads)
    return [counts[layer].clamp(max=s.shape[1]) for layer, s in enumerate(scores)]

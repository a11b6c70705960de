"""SnapKV: every head keeps the same number of tokens, its highest-scoring ones."""

from __future__ import annotations

import torch


def allocate(scores: list[torch.Tensor], selectable: int, **_) -> list[torch.Tensor]:
    """Tokens each kv head selects ``[kv_heads]`` per layer: ``selectable`` each (at most
    what it has)."""
    return [torch.full((s.shape[0],), min(selectable, s.shape[1]), dtype=torch.long)
            for s in scores]  # fmt: skip

"""Which positions each head keeps under a :class:`KVBudget`: the policies' division of the
budget (``POLICIES``, one file each) and the top-scoring positions it gives each head."""

from __future__ import annotations

from typing import get_args

import torch

from headspace.budgets import ada_snapkv, headkv, snapkv
from headspace.budgets.spec import KVBudget, PolicyName

POLICIES = {"snapkv": snapkv.allocate, "ada_snapkv": ada_snapkv.allocate,
            "headkv": headkv.allocate}  # fmt: skip
assert tuple(POLICIES) == get_args(PolicyName)


def selected_counts(budget: KVBudget, scores: list[torch.Tensor], prompt_len: int,
                    head_scores: torch.Tensor | None = None) -> list[torch.Tensor]:  # fmt: skip
    """Tokens each kv head selects besides the observation window, per layer ``[kv_heads]``
    int64: the policy's division of the budget over every head of ``scores`` (per layer
    ``[kv_heads, prompt_len - window]``). headkv reads only their shapes, so meta tensors
    serve it before any layer is scored."""
    selectable = budget.tokens(prompt_len) - min(budget.window, prompt_len)
    return POLICIES[budget.policy](scores, selectable, head_scores=head_scores)


def kept_positions(
    budget: KVBudget,
    scores: list[torch.Tensor],  # per layer [kv_heads, prompt_len - window]
    prompt_len: int,
    head_scores: torch.Tensor | None = None,  # [layers, kv_heads] (headkv)
    heads: list[list[int]] | None = None,  # per layer, the kv heads to return (None: all)
    counts: list[torch.Tensor] | None = None,  # per layer [kv_heads]: selected_counts's
) -> list[list[torch.Tensor]]:
    """Positions each (layer, kv head) keeps, ascending int64 on the scores' device (a GPU
    ranks 128K scores per head in milliseconds, a CPU in seconds), the observation window's
    last tokens included; everything when the budget covers the prompt. The policy divides
    the budget over every head of ``scores`` unless ``counts`` says what each selects;
    ``heads`` picks whose positions to return."""
    heads = heads or [range(layer.shape[0]) for layer in scores]
    device = scores[0].device if scores else None
    if budget.tokens(prompt_len) >= prompt_len:  # the budget covers the prompt: exact
        return [[torch.arange(prompt_len, device=device) for _ in layer] for layer in heads]
    window = min(budget.window, prompt_len)
    window_positions = torch.arange(prompt_len - window, prompt_len, device=device)
    if counts is None:
        counts = selected_counts(budget, scores, prompt_len, head_scores)
    kept = []
    for layer_scores, layer_counts, layer_heads in zip(scores, counts, heads, strict=True):
        num_kept = layer_counts.tolist()  # one read per layer
        rows = []
        for h in layer_heads:
            top = layer_scores[h].topk(num_kept[h]).indices.sort().values
            rows.append(torch.cat([top, window_positions]))
        kept.append(rows)
    return kept

"""Per-head KV budgets: after prefill each (layer, kv head) keeps only its highest-scoring
tokens, by observation-window attention (``scores.py``); policies (one file each) decide how
many tokens each head keeps.

- ``snapkv``: the same number for every head.
- ``ada_snapkv``: a layer's total shared by its heads, which compete by score.
- ``headkv``: the model's total divided across layers and heads by a profile's head scores.

A budget is the average number of tokens kept per head: a float in (0, 1] is a fraction of
each prompt, an int a number of tokens. The observation window (the prompt's last tokens)
is always kept and counts towards it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from headspace.budgets import ada_snapkv, headkv, snapkv
from headspace.budgets.scores import POOL, WINDOW, observation_scores

PolicyName = Literal["snapkv", "ada_snapkv", "headkv"]
POLICIES = {"snapkv": snapkv.allocate, "ada_snapkv": ada_snapkv.allocate,
            "headkv": headkv.allocate}  # fmt: skip
assert tuple(POLICIES) == get_args(PolicyName)
# a layer's counts follow from its own scores alone (headkv's from the profile and the
# shapes of every layer's: known before any is scored)
LAYER_LOCAL = {"snapkv", "ada_snapkv"}

__all__ = ["LAYER_LOCAL", "POLICIES", "PolicyName", "KVBudget", "kept_positions",
           "observation_scores", "selected_counts", "POOL", "WINDOW"]  # fmt: skip


@dataclass(frozen=True)
class KVBudget:
    """How much KV each head keeps after prefill, and which policy divides it."""

    value: float | int  # float in (0, 1]: fraction of the prompt; int >= 1: tokens per head
    policy: str = "snapkv"
    window: int = WINDOW
    pool: int = POOL  # odd max-pool width of the scores over neighbouring tokens

    def __post_init__(self):
        value = self.value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"kv_budget must be a number, got {value!r}")
        if isinstance(value, float) and value > 1 and value.is_integer():
            object.__setattr__(self, "value", value := int(value))  # tokens, given as 4096.0
        if value <= 0 or (isinstance(value, float) and value > 1):
            raise ValueError(f"kv_budget must be a fraction of the prompt in (0, 1] or a token "
                             f"count of at least {self.window}, got {value}")  # fmt: skip
        if isinstance(value, int) and value < self.window:
            raise ValueError(f"a kv_budget of {value} tokens is below the {self.window}-token "
                             f"observation window every policy keeps")  # fmt: skip
        if self.policy not in POLICIES:
            raise ValueError(f"kv_policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if type(self.pool) is not int or self.pool < 1 or self.pool % 2 == 0:
            raise ValueError(f"kv_pool must be an odd positive integer, got {self.pool!r}")

    def tokens(self, prompt_len: int) -> int:
        """Average tokens kept per head for a prompt of ``prompt_len`` (window included)."""
        kept = round(self.value * prompt_len) if isinstance(self.value, float) else self.value
        return min(prompt_len, max(kept, min(self.window, prompt_len)))

    def most_held(self, prompt_len: int, max_tokens: int) -> int:
        """Most tokens one head can hold by ``max_tokens`` after a ``prompt_len`` prompt:
        snapkv's even share and the new tokens; a policy whose heads share a total may give
        one head everything."""
        if self.policy != "snapkv":
            return max_tokens
        return self.tokens(prompt_len) + max_tokens - prompt_len


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

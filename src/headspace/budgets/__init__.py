"""Per-head KV budgets: after prefill each (layer, kv head) keeps only its highest-scoring
tokens, by observation-window attention (``scores.py``); policies (one file each) decide how
many tokens each head keeps.

- ``snapkv``: the same number for every head.
- ``ada_snapkv``: a layer's total shared by its heads, which compete by score.
- ``headkv``: the model's total divided across layers and heads by a profile's head scores.

A budget is the average number of tokens kept per head: a float in (0, 1] is a fraction of
each prompt, an int a number of tokens. The observation window (the prompt's last tokens)
is always kept and counts towards it.

The names below load on first use, so that what a budget is (``budgets.spec``) imports
without torch.
"""

from __future__ import annotations

from headspace.lazy import lazy_names

_HOMES = {
    "KVBudget": ".spec", "PolicyName": ".spec", "LAYER_LOCAL": ".spec", "POOL": ".spec",
    "WINDOW": ".spec", "POLICIES": ".select", "kept_positions": ".select",
    "selected_counts": ".select", "observation_scores": ".scores",
}  # fmt: skip
__all__ = list(_HOMES)
__getattr__ = lazy_names(__name__, _HOMES)

"""What a KV budget is, without torch (the CLI's flags and the pure planner read it): the
policies' names, the observation window, the scores' pooling width and :class:`KVBudget`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

WINDOW = 32  # observation window: the prompt's last queries, always kept
# max-pool width over neighbouring tokens: SnapKV keeps clusters, not lone tokens. 15, not
# SnapKV's 7: an answer sits some tokens after the words the question matches (NIAH and RULER
# on the embedded model, bench/NOTES.md "Pooling width")
POOL = 15

PolicyName = Literal["snapkv", "ada_snapkv", "headkv"]
# a layer's counts follow from its own scores alone (headkv's from the profile and the
# shapes of every layer's: known before any is scored)
LAYER_LOCAL = {"snapkv", "ada_snapkv"}


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
        if self.policy not in get_args(PolicyName):
            raise ValueError(f"kv_policy must be one of {', '.join(get_args(PolicyName))}, got "
                             f"{self.policy!r}")  # fmt: skip
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

"""How much of a long prompt one step carries beside decoding sequences, in the relative
work of its layers: pure arithmetic over token counts (the scheduler's prompt pieces)."""

from __future__ import annotations


def layer_cost(start: int, end: int, attention_prefix: int) -> float:
    """Relative cost of prompt tokens ``start .. end-1`` in one layer: their linear layers
    and their attention over the tokens before (on average ``start`` + half of them), a
    token's attention over ``attention_prefix`` earlier tokens costing as much as its linear
    layers."""
    return (end - start) * (1 + (start + end) / 2 / attention_prefix)


def step_work(step_tokens: int, num_layers: int, attention_prefix: int) -> float:
    """One step's prompt work beside decoding sequences: tokens ``0 .. step_tokens-1``
    through every layer."""
    return num_layers * layer_cost(0, step_tokens, attention_prefix)


def layers_per_step(start: int, end: int, work: float, attention_prefix: int) -> int:
    """Layers of tokens ``start .. end-1`` that fit one step's prompt ``work`` (at least
    one)."""
    return max(1, int(work // layer_cost(start, end, attention_prefix)))


def slice_size(start: int, num_tokens: int, chunk: int, page: int, work: float,
               attention_prefix: int) -> int:  # fmt: skip
    """The length of a chunk run in layer slices from ``start`` (of a prompt of
    ``num_tokens``): ``chunk``, halved (down to a ``page``) while one layer of what it
    covers costs more than a step's prompt ``work``, so that deep in a long prompt a step
    still fits its work."""
    size = chunk
    while size > page and layer_cost(start, min(start + size, num_tokens), attention_prefix) > work:
        size = max(page, size // 2 // page * page)
    return size


__all__ = ["layer_cost", "layers_per_step", "slice_size", "step_work"]

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


def decode_work(num_layers: int, weight_work: float, kv_work: float,
                context_tokens: int) -> float:  # fmt: skip
    """A decode step's cost in prompt work: each layer's weights read once (as long as
    ``weight_work`` prompt tokens' linear layers there) and the K/V of the batch's
    ``context_tokens`` (``kv_work`` a token)."""
    return num_layers * (weight_work + kv_work * context_tokens)


def queued_step_work(base: float, slowdown: float, decode: float) -> float:
    """A step's prompt work while prompts wait their turn: enough that the step takes up to
    ``slowdown`` times the decode step alone (``decode``, its work), never less than
    ``base`` (the work while none waits)."""
    return max(base, (slowdown - 1) * decode)


def mixed_piece_work(base: float, slowdown: float, rates: tuple[float, float], rows: int,
                     context_tokens: int, capped: bool) -> float:  # fmt: skip
    """A piece's work in one layer of a step that runs it with ``rows`` decode rows in one
    forward (their linear layers read the layer's weights once): where ``capped``, enough
    that the step takes up to ``slowdown`` times the decode rows' step alone, whose layer
    costs ``max(weight_work, rows) + kv_work * context_tokens`` (``rates``:
    :func:`decode_work`'s), the piece's first ``weight_work - rows`` tokens hidden under the
    weights' read; never less than ``base`` (else ``base`` alone)."""
    if not capped:
        return base
    weight_work, kv_work = rates
    decode = max(weight_work, rows) + kv_work * context_tokens
    return max(base, (slowdown - 1) * decode + max(0.0, weight_work - rows))


def piece_size(start: int, num_tokens: int, work: float, page: int, most: int,
               attention_prefix: int) -> int:  # fmt: skip
    """The most tokens from ``start`` (of a prompt of ``num_tokens``), in whole pages unless
    the prompt ends first, at most ``most``, whose layer costs at most ``work``
    (:func:`layer_cost`); at least one page."""
    fits = 1
    low, high = 1, max(1, -(-min(most, num_tokens - start) // page))  # in pages
    while low <= high:
        middle = (low + high) // 2
        if layer_cost(start, min(start + middle * page, num_tokens), attention_prefix) <= work:
            fits, low = middle, middle + 1
        else:
            high = middle - 1
    return min(fits * page, num_tokens - start, most)


def grown_piece(tokens: int, scale: float, page: int) -> int:
    """A piece of ``tokens`` (through every layer) given ``scale`` times its work: whole
    pages of ``tokens * scale``, never fewer than ``tokens``."""
    return max(tokens, int(tokens * scale) // page * page)


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


__all__ = [
    "decode_work",
    "grown_piece",
    "layer_cost",
    "layers_per_step",
    "mixed_piece_work",
    "piece_size",
    "queued_step_work",
    "slice_size",
    "step_work",
]

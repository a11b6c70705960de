"""What patterns and KV budgets change in a plan, for its memory table and roofline: the
tokens an entry holds after the prompt, and the share of full causal attention its prefill
computes."""

from __future__ import annotations

from dataclasses import replace

from headspace.errors import UserError
from headspace.kv.spec import (
    BLOCK,
    FORCED_LOCAL,
    FORCED_SINK,
    LAST_QUERIES,
    Pattern,
    byte_size,
    padded_length,
    prefix_piece,
)
from headspace.planner.head_map import HeadMap


def kept_tokens(pattern: str, budget_tokens: int | None) -> int | None:
    """Tokens one (layer, kv head) entry keeps of a prompt: a streaming head its sink and
    window, a budgeted one its budget (``budget_tokens``), else None (all)."""
    spec = Pattern.parse(pattern)
    return sum(spec.params) if spec.kind == "streaming" else budget_tokens


def held_tokens(pattern: str, budget_tokens: int | None, context: int) -> int:
    """Tokens one entry holds after a ``context``-token prompt (see :func:`kept_tokens`)."""
    kept = kept_tokens(pattern, budget_tokens)
    return context if kept is None else min(context, kept)


def attended_keys(pattern: str, context: int) -> int:
    """Keys one query late in a ``context``-token prompt attends under ``pattern``, at most
    ``context`` (streaming: sink + window; block_sparse(k): k blocks of 128; vertical_slash(v,
    s): its key blocks and block diagonals, the forced ones included)."""
    spec = Pattern.parse(pattern)
    if spec.kind == "full":
        return context
    keys = sum(spec.params)
    if spec.kind == "block_sparse":
        keys = spec.params[0] * BLOCK
    elif spec.kind == "vertical_slash":
        vertical, slash = (-(-n // BLOCK) for n in spec.params)
        keys = (vertical + FORCED_SINK + slash + FORCED_LOCAL) * BLOCK
    return min(keys, context)


def attention_share(pattern: str, context: int) -> float:
    """The share of a full causal prefill's (query, key) pairs that ``pattern``'s kernel
    computes over a ``context``-token prompt, at most 1: each query sees at most
    :func:`attended_keys` keys."""
    kept = attended_keys(pattern, context)
    if kept >= context:  # every key (full, or a pattern wider than the prompt)
        return 1.0
    pairs = kept * (kept + 1) / 2 + (context - kept) * kept  # sum over queries of min(p+1, K)
    return pairs / (context * (context + 1) / 2)


def resident_shares(head_map: HeadMap, context: int, budget_tokens: int | None) -> tuple:
    """``(entry-tokens held by the resident entries after the prompt, mean attention share
    over all entries)``; offloaded entries attend exactly and hold everything."""
    held, shares = 0, []
    for entry in head_map.entries:
        resident = entry.tier == "gpu"
        pattern = entry.pattern if resident else "full"
        shares.append(attention_share(pattern, context))
        if resident:
            held += held_tokens(pattern, budget_tokens, context)
    return held, sum(shares) / len(shares)


def with_budgets(head_map: HeadMap, budget_tokens: int | None) -> HeadMap:
    """``head_map`` with each entry's ``budget`` (tokens kept after the prompt): a streaming
    entry its sink and window, the others ``budget_tokens`` (None: all)."""
    entries = [replace(e, budget=kept_tokens(e.pattern, budget_tokens)) for e in head_map.entries]
    return HeadMap(head_map.num_layers, head_map.num_kv_heads, entries)


def gathered_bytes(num_kv_heads: int, q_per_kv: int, head_dim: int, dtype_bytes: int,
                   context: int) -> int:  # fmt: skip
    """GPU bytes a prefill chunk of a layer with patterns or budgets gathers at most: the
    layer's K and V padded to the key capacity, twice (the full kv heads' share is copied
    again for the fused kernel), and vertical-slash estimation's scratch for one kv head's
    query heads (four fp32 ``[heads, 64, keys]`` buffers and the bool mask of the 64
    queries' future keys)."""
    capacity = padded_length(context)
    keys = 2 * num_kv_heads * capacity * head_dim * dtype_bytes
    return 2 * keys + (4 * q_per_kv * 4 + 1) * LAST_QUERIES * capacity


def ring_gathered_bytes(num_kv_heads: int, head_dim: int, dtype_bytes: int, context: int,
                        chunk: int, pattern: Pattern) -> int:  # fmt: skip
    """GPU bytes a prefill chunk of a layer whose heads are ``full`` or ``pattern``
    (``streaming``) gathers at most: a prefix piece's K/V of every kv head and the full
    heads' copy of it, the streaming heads' sink, window and chunk (padded), and the
    layer's int64 slots of every position (four tensors of them while they are found)."""
    piece = 2 * num_kv_heads * min(prefix_piece(chunk), context) * head_dim * dtype_bytes
    ring = 2 * num_kv_heads * padded_length(sum(pattern.params) + chunk) * head_dim * dtype_bytes
    return 2 * piece + ring + 4 * num_kv_heads * context * 8


def prefill_gathers(num_kv_heads: int, q_per_kv: int, head_dim: int, dtype_bytes: int,
                    context: int, chunk: int, *, budgets: bool,
                    pattern: str | None) -> int:  # fmt: skip
    """GPU bytes a layer's prefill gathers besides its activations: with KV budgets (the
    prompt's keys are scored) or patterns other than ``streaming``, every key
    (:func:`gathered_bytes`); with ``streaming`` patterns (``pattern``: the sparse heads'
    pattern, None without patterns) what they see (:func:`ring_gathered_bytes`); else 0."""
    if not budgets and pattern is None:
        return 0
    sparse = None if pattern is None else Pattern.parse(pattern)
    if budgets or sparse.kind != "streaming":
        return gathered_bytes(num_kv_heads, q_per_kv, head_dim, dtype_bytes, context)
    return ring_gathered_bytes(num_kv_heads, head_dim, dtype_bytes, context, chunk, sparse)


def arena_after_gathers(arena: int, gathered: int, context: int) -> int:
    """The KV arena left once a layer's prefill gathers ``gathered`` bytes (patterns or
    budgets at ``context`` tokens: :func:`prefill_gathers`); UserError with the numbers when
    nothing is left."""
    if arena <= gathered:
        raise UserError(
            f"GPU budget too small: after weights, activations and decode it leaves "
            f"{byte_size(arena)}, less than the {byte_size(gathered)} a layer's "
            f"prefill gathers with patterns or KV budgets at {context} tokens"
        )
    return arena - gathered

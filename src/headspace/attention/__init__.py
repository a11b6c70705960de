"""Attention over KV views: every path returns ``(out, lse)``; partial results merge exactly.

Layouts: ``q [heads, q_tokens, dim]``, ``k, v [kv_heads, kv_tokens, dim]`` (grouped heads),
``out`` like q, ``lse [heads, q_tokens]`` natural-log fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from headspace.attention.flex import flex_attention_dense
from headspace.attention.merge import merge_attention
from headspace.attention.reference import reference_attention
from headspace.attention.sdpa import sdpa_attention

BACKENDS = {"reference": reference_attention, "sdpa": sdpa_attention, "flex": flex_attention_dense}

__all__ = [
    "BACKENDS",
    "attend",
    "attend_spans",
    "decode_attend",
    "merge_attention",
    "reference_attention",
]


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    backend: str | Callable = "sdpa",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over k/v with the named backend (or a function of the backends'
    arguments, e.g. one given options); causal is aligned to the key end.

    A causal call with fewer queries than keys (a prefill chunk after a prefix) runs as
    a non-causal part over the prefix and a causal square part, merged by LSE.
    """
    fn = BACKENDS[backend] if isinstance(backend, str) else backend
    num_q, num_kv = q.shape[1], k.shape[1]
    if not causal or num_q == num_kv:
        return fn(q, k, v, causal=causal, scale=scale)
    assert num_q < num_kv, "more queries than keys under a causal mask"
    prefix = num_kv - num_q
    past = fn(q, k[:, :prefix], v[:, :prefix], causal=False, scale=scale)
    diagonal = fn(q, k[:, prefix:], v[:, prefix:], causal=True, scale=scale)
    return merge_attention([past[0], diagonal[0]], [past[1], diagonal[1]])


def attend_spans(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    span: int | None,
    *,
    backend: str | Callable = "sdpa",
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attend` (not causal) over the keys in runs of at most ``span`` (None: one
    run), merged by LSE: the same result, from kernels whose thread blocks each read at most
    ``span`` keys (shorter blocks, which other streams' kernels wait for less)."""
    num_kv = k.shape[1]
    if span is None or num_kv <= span:
        return attend(q, k, v, backend=backend)
    parts = [attend(q, k[:, s : s + span], v[:, s : s + span], backend=backend)
             for s in range(0, num_kv, span)]  # fmt: skip
    return merge_attention([p[0] for p in parts], [p[1] for p in parts])


def decode_attend(
    q: torch.Tensor,  # [heads, 1, dim]
    k: torch.Tensor,  # [kv_heads, capacity, dim]
    v: torch.Tensor,
    length: torch.Tensor,  # [1] int on q's device: number of valid keys
    *,
    new_kv: torch.Tensor | None = None,  # [2, 1, kv_heads, dim]
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token over the first ``length`` keys of a static buffer (graph-safe on GPU).

    With ``new_kv``, the query token's own K/V is first stored at position ``length - 1``.
    """
    if q.is_cuda:
        from headspace.attention.triton_decode import triton_decode_attention

        return triton_decode_attention(q, k, v, length, new_kv=new_kv, scale=scale)
    num_valid = int(length.item())
    if new_kv is not None:
        k[:, num_valid - 1], v[:, num_valid - 1] = new_kv[0, 0], new_kv[1, 0]
    return reference_attention(q, k[:, :num_valid], v[:, :num_valid], scale=scale)

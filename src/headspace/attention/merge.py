"""Exact merge of partial attention states by log-sum-exp: on a GPU a Triton kernel per pair
of states (:mod:`headspace.attention.merge_kernel`), on the CPU (and while torch compiles)
torch's operations."""

from __future__ import annotations

import torch


def merge_attention(
    outs: list[torch.Tensor],
    lses: list[torch.Tensor],
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over disjoint key sets into attention over their union.

    ``outs[i]`` is ``[heads, tokens, dim]`` and ``lses[i]`` its ``[heads, tokens]``
    natural-log normaliser (-inf where part ``i`` saw no key). Returns ``(out, lse)``
    with out in the dtype of ``outs[0]`` (written into ``out`` when given, which may be
    ``outs[0]`` itself but must overlap no other part otherwise) and an fp32 lse (into
    ``lse_out`` when given, likewise); rows empty in every part give 0 and -inf.
    """
    assert outs and len(outs) == len(lses)
    if len(outs) > 1 and outs[0].is_cuda and not torch.compiler.is_compiling():
        return merged_by_kernel(outs, lses, out, lse_out)
    merged, lse = _merged(outs, lses)
    if out is not None:
        merged = out.copy_(merged)
    if lse_out is not None:
        lse = lse_out.copy_(lse)
    return merged, lse


def merged_by_kernel(
    outs: list[torch.Tensor],
    lses: list[torch.Tensor],
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_attention` through the Triton kernel, the parts two at a time (between
    pairs an fp32 state, rounded to ``outs[0]``'s dtype once, at the last pair, as torch's
    sum is); the last pair writes into ``out`` and ``lse_out``."""
    from headspace.attention.merge_kernel import merge_pair

    result = outs[0], lses[0]
    for i in range(1, len(outs)):
        last = i == len(outs) - 1
        into = out if last else None
        if into is None:
            dtype = outs[0].dtype if last else torch.float32
            into = torch.empty(outs[0].shape, dtype=dtype, device=outs[0].device)
        result = merge_pair(*result, outs[i], lses[i], into, lse_out if last else None)
    return result


def _merged(outs: list[torch.Tensor], lses: list[torch.Tensor]):
    """:func:`merge_attention` through torch's operations."""
    if len(outs) == 1:
        return outs[0], lses[0]
    lse_stack = torch.stack([lse.float() for lse in lses])  # [parts, heads, tokens]
    lse = torch.logsumexp(lse_stack, dim=0)
    weights = torch.exp(lse_stack - lse).nan_to_num(0.0)  # [parts, heads, tokens]
    out = sum(w[..., None] * o.float() for w, o in zip(weights, outs, strict=True))
    return out.to(outs[0].dtype), lse

"""What one kv head (with its query heads) costs a rank in one step: the cost model the
head-parallel solvers balance (``parallel.solvers``).

A head's cost has a part that copies of it divide (attention over its K/V), a part each
copy repeats (its rows of the q/k/v/o projections) and, once it is divided, what each copy
adds (its key range, its own kernel launches and its part of the merge). They come from the
roofline (``Hardware`` rates), by the entry's tier, pattern and budget; with a profile's
measured pattern costs (its ``pattern_ms``, the runtime profile), a head's attention is that
measurement scaled by the roofline from the measured context and chunk to the asked ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from headspace.planner.head_map import HeadEntry, HeadMap
from headspace.planner.memory import Hardware
from headspace.planner.profile import Profile
from headspace.planner.sparsity import attended_keys, held_tokens

PHASES = ("prefill", "decode")


@dataclass(frozen=True)
class HeadCost:
    """Seconds one kv head with its query heads costs a rank in one step."""

    split: float  # work copies divide between them (attention over its K/V)
    fixed: float = 0.0  # work each copy repeats (its rows of the q/k/v/o projections)
    copy: float = 0.0  # what each copy adds once the head is divided (launches, its merge)

    @property
    def total(self) -> float:
        return self.split + self.fixed


@dataclass(frozen=True)
class CostShape:
    """The model's sizes the cost model reads: a kv head's query heads, head and hidden
    widths, and bytes per element."""

    q_per_kv: int
    head_dim: int
    hidden_size: int
    dtype_bytes: int = 2

    @classmethod
    def of(cls, config, dtype_bytes: int = 2) -> CostShape:
        return cls(config.num_queries_per_kv, config.head_dim, config.hidden_size, dtype_bytes)

    @property
    def weight_elements(self) -> int:
        """Projection weights of one kv head: q and o rows of its query heads, k and v."""
        return (2 * self.q_per_kv + 2) * self.head_dim * self.hidden_size


def roofline_cost(entry: HeadEntry, shape: CostShape, hw: Hardware, *, phase: str,
                  context: int, chunk: int = 8192, batch: int = 1) -> HeadCost:  # fmt: skip
    """Cost of ``entry`` in one step. ``prefill``: a chunk of ``chunk`` queries at the end of a
    ``context``-token prompt (attention FLOPs over the keys its pattern attends; the streamed
    tiers compute the same attention). ``decode``: one token for each of ``batch`` sequences
    of ``context`` tokens (the bytes it holds, at HBM speed resident, at PCIe speed streamed,
    at PCIe plus CPU speed in the hybrid tier; each copy repeats its projection rows and the
    kernel's work per row, and adds a merge and its work per sequence)."""
    if phase == "prefill":
        flops = 4 * shape.q_per_kv * shape.head_dim * chunk * attended_keys(entry.pattern, context)
        gemm = 2 * chunk * shape.weight_elements
        return HeadCost(flops / hw.attention_flops, gemm / hw.gemm_flops, hw.copy_seconds)
    if phase != "decode":
        raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
    held = held_tokens(entry.pattern, entry.budget, context)
    kv_bytes = batch * held * 2 * shape.head_dim * shape.dtype_bytes
    rate = {"gpu": hw.hbm_bytes, "stream": hw.h2d_bytes,
            "hybrid": hw.h2d_bytes + hw.cpu_attention_bytes}[entry.tier]  # fmt: skip
    weights = shape.weight_elements * shape.dtype_bytes
    fixed = weights / hw.hbm_bytes + batch * hw.decode_row_seconds
    return HeadCost(kv_bytes / rate, fixed, hw.copy_seconds + batch * hw.copy_row_seconds)


def measured_cost(entry: HeadEntry, shape: CostShape, hw: Hardware, profile: Profile, *,
                  context: int, chunk: int = 8192) -> HeadCost | None:  # fmt: skip
    """Prefill cost from the profile's measured ms of ``entry``'s pattern at its nearest
    measured context, scaled by the roofline to ``context`` and ``chunk``; None when the
    profile did not measure the pattern."""
    measured = profile.pattern_ms.get(entry.pattern)
    if not measured or not profile.chunk:
        return None
    at = min((int(c) for c in measured), key=lambda c: abs(math.log(c / context)))
    there = roofline_cost(entry, shape, hw, phase="prefill", context=at, chunk=profile.chunk)
    here = roofline_cost(entry, shape, hw, phase="prefill", context=context, chunk=chunk)
    return HeadCost(measured[str(at)] / 1000 * here.split / there.split, here.fixed, here.copy)


def head_costs(head_map: HeadMap, shape: CostShape, hw: Hardware | None = None, *,
               phase: str, context: int, chunk: int = 8192, batch: int = 1,
               profile: Profile | None = None) -> list[list[HeadCost]]:  # fmt: skip
    """``[layer][kv_head]`` costs of one step of ``phase`` (see :func:`roofline_cost`); a
    prefill uses the profile's measurement of a pattern where it has one."""
    hw = hw or Hardware()
    costs = []
    for layer in range(head_map.num_layers):
        row = []
        for entry in head_map.layer(layer):
            cost = None
            if profile is not None and phase == "prefill":
                cost = measured_cost(entry, shape, hw, profile, context=context, chunk=chunk)
            row.append(cost or roofline_cost(entry, shape, hw, phase=phase, context=context,
                                             chunk=chunk, batch=batch))  # fmt: skip
        costs.append(row)
    return costs

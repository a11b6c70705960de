"""Attention patterns per head (FlexAttn, MInference, DuoAttention): which keys each query of
a head attends during prefill.

- ``full``: every earlier key (causal).
- ``streaming(sink, window)`` (A-shape): the first ``sink`` keys and the ``window`` most
  recent ones.
- ``vertical_slash(v, s)``: ``v`` key columns and ``s`` diagonals (query position minus key
  position), chosen per head and chunk from the chunk's last queries (MInference).
- ``block_sparse(k)``: ``k`` key blocks of 128 tokens per query block, chosen per head and
  chunk from block-averaged queries and keys, with the first block and the diagonal.

A :class:`Pattern` is the head map's spec; :func:`estimate` turns the specs of a layer's
heads into :class:`HeadPatterns`, lookup tables for one chunk (a mask function indexes them,
and ``blocks.py`` builds FlexAttention block masks from them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

BLOCK = 128  # tokens per query and key block of the block masks
LAST_QUERIES = 64  # queries of a chunk that estimate vertical-slash (MInference's last_q)
FORCED_SINK = 4  # key columns every vertical-slash head keeps (attention sinks)
FORCED_LOCAL = 64  # diagonals every vertical-slash head keeps (the local window)
KINDS = {"full": (), "streaming": ("sink", "window"), "vertical_slash": ("vertical", "slash"),
         "block_sparse": ("blocks",)}  # fmt: skip
KIND_IDS = {kind: i for i, kind in enumerate(KINDS)}


@dataclass(frozen=True)
class Pattern:
    """One head's pattern: a kind and its integer parameters (see the module doc)."""

    kind: str = "full"
    params: tuple[int, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"pattern must be one of {', '.join(KINDS)}, got {self.kind!r}")
        names = KINDS[self.kind]
        if len(self.params) != len(names) or any(type(p) is not int for p in self.params):
            raise ValueError(f"{self.kind} takes integers ({', '.join(names)}), got {self.params}")
        low = {"sink": 0}
        for name, value in zip(names, self.params, strict=True):
            if value < low.get(name, 1):
                raise ValueError(f"{self.kind}: {name} must be at least {low.get(name, 1)}")

    def __str__(self) -> str:
        return self.kind if not self.params else f"{self.kind}({','.join(map(str, self.params))})"

    @classmethod
    def parse(cls, text: str) -> Pattern:
        """``full``, ``streaming(4,1024)``, ``vertical_slash(1000,6000)``, ``block_sparse(16)``."""
        match = re.fullmatch(r"\s*(\w+)\s*(?:\(([\d,\s]*)\))?\s*", text)
        if match is None:
            raise ValueError(f"cannot read the pattern {text!r}")
        params = tuple(int(p) for p in (match.group(2) or "").split(",") if p.strip())
        return cls(match.group(1), params)

    @property
    def is_full(self) -> bool:
        return self.kind == "full"


@dataclass
class HeadPatterns:
    """A layer's query heads' patterns for one chunk of ``num_queries`` queries at positions
    ``q_start ..`` over ``num_keys`` keys (positions ``0 ..``), as lookup tables."""

    q_start: int
    num_queries: int
    num_keys: int
    kind: torch.Tensor  # [heads] int: KIND_IDS
    sink: torch.Tensor  # [heads] int (streaming)
    window: torch.Tensor  # [heads] int (streaming)
    # 0/1 int32 (compiled FlexAttention kernels index int tables):
    vertical: torch.Tensor  # [heads, keys]: key columns kept (vertical_slash)
    slash: torch.Tensor  # [heads, keys]: diagonals kept, by query minus key position
    blocks: torch.Tensor  # [heads, query blocks, key blocks] (block_sparse)

    def mask_mod(self, b, h, q_idx, kv_idx):
        """FlexAttention's mask function: query ``q_idx`` of the chunk, key ``kv_idx``."""
        q_pos = q_idx + self.q_start
        causal = (kv_idx <= q_pos) & (kv_idx < self.num_keys)
        kind = self.kind[h]
        offset = (q_pos - kv_idx).clamp(0, self.num_keys - 1)
        column = kv_idx.clamp(0, self.num_keys - 1)
        streaming = (kv_idx < self.sink[h]) | (q_pos - kv_idx < self.window[h])
        lines = (self.vertical[h, column] + self.slash[h, offset]) > 0
        block = self.blocks[h, (q_idx // BLOCK).clamp(0, self.blocks.shape[1] - 1),
                            column // BLOCK] > 0  # fmt: skip
        allowed = (kind == KIND_IDS["full"]) | ((kind == KIND_IDS["streaming"]) & streaming)
        allowed = allowed | ((kind == KIND_IDS["vertical_slash"]) & lines)  # out of place:
        allowed = allowed | ((kind == KIND_IDS["block_sparse"]) & block)  # compiled kernels
        return causal & allowed

    def select(self, heads: torch.Tensor) -> HeadPatterns:
        """The tables of the query heads where ``heads [heads]`` (bool) is set."""
        return HeadPatterns(self.q_start, self.num_queries, self.num_keys, self.kind[heads],
                            self.sink[heads], self.window[heads], self.vertical[heads],
                            self.slash[heads], self.blocks[heads])  # fmt: skip

    def dense(self) -> torch.Tensor:
        """The mask ``[heads, queries, keys]`` in full (the reference twin's)."""
        heads = torch.arange(self.kind.numel(), device=self.kind.device)[:, None, None]
        q_idx = torch.arange(self.num_queries, device=self.kind.device)[None, :, None]
        kv_idx = torch.arange(self.num_keys, device=self.kind.device)[None, None, :]
        return self.mask_mod(0, heads, q_idx, kv_idx)


def estimate(
    patterns: list[Pattern],  # one per query head
    q: torch.Tensor,  # [heads, queries, dim]: the chunk's queries (rotated)
    k: torch.Tensor,  # [kv_heads, keys, dim]: every key up to the chunk's last, the chunk's too
    *,
    scale: float | None = None,
) -> HeadPatterns:
    """Each head's lookup tables for this chunk: vertical-slash and block-sparse heads are
    estimated from the chunk's queries; the others read their parameters."""
    num_heads, num_q, dim = q.shape
    num_keys, device = k.shape[1], q.device
    if len(patterns) != num_heads:
        raise ValueError(f"{len(patterns)} patterns for {num_heads} query heads")
    scale = dim**-0.5 if scale is None else scale
    q_start = num_keys - num_q
    num_qb, num_kb = -(-num_q // BLOCK), -(-num_keys // BLOCK)
    table = HeadPatterns(
        q_start, num_q, num_keys,
        kind=torch.tensor([KIND_IDS[p.kind] for p in patterns], device=device),
        sink=torch.tensor([p.params[0] if p.kind == "streaming" else 0 for p in patterns],
                          device=device),
        window=torch.tensor([p.params[1] if p.kind == "streaming" else 0 for p in patterns],
                            device=device),
        vertical=torch.zeros(num_heads, num_keys, dtype=torch.int32, device=device),
        slash=torch.zeros(num_heads, num_keys, dtype=torch.int32, device=device),
        blocks=torch.zeros(num_heads, num_qb, num_kb, dtype=torch.int32, device=device),
    )  # fmt: skip
    group = num_heads // k.shape[0]
    for head, pattern in enumerate(patterns):
        keys = k[head // group]
        if pattern.kind == "vertical_slash":
            vertical, slash = _vertical_slash(q[head], keys, q_start, *pattern.params, scale)
            table.vertical[head, vertical], table.slash[head, slash] = 1, 1
        elif pattern.kind == "block_sparse":
            table.blocks[head] = _block_sparse(
                q[head], keys, q_start, pattern.params[0], scale
            ).int()
    return table


def _vertical_slash(q, k, q_start: int, num_vertical: int, num_slash: int, scale: float):
    """Key columns and diagonals most attended by the chunk's last queries (MInference),
    with the first keys and the nearest diagonals always in."""
    num_q, num_keys = q.shape[0], k.shape[0]
    last = min(LAST_QUERIES, num_q)
    positions = torch.arange(q_start + num_q - last, q_start + num_q, device=q.device)
    logits = (q[-last:].float() @ k.float().T) * scale  # [last, keys]
    columns = torch.arange(num_keys, device=q.device)
    logits = logits.masked_fill(columns[None, :] > positions[:, None], float("-inf"))
    weights = torch.softmax(logits, dim=-1)
    vertical = weights.sum(0)
    vertical[: min(FORCED_SINK, num_keys)] = float("inf")
    offsets = (positions[:, None] - columns[None, :]).clamp(min=0)  # [last, keys]
    slash = torch.zeros(num_keys, device=q.device).scatter_add_(
        0, offsets.flatten(), weights.flatten()
    )
    slash[: min(FORCED_LOCAL, num_keys)] = float("inf")
    return (vertical.topk(min(num_vertical, num_keys)).indices,
            slash.topk(min(num_slash, num_keys)).indices)  # fmt: skip


def _block_sparse(q, k, q_start: int, num_blocks: int, scale: float) -> torch.Tensor:
    """``[query blocks, key blocks]``: each query block's ``num_blocks`` key blocks with the
    highest score between block-averaged query and key, the first and diagonal ones always."""
    num_q, num_keys = q.shape[0], k.shape[0]
    num_qb, num_kb = -(-num_q // BLOCK), -(-num_keys // BLOCK)
    q_blocks = _block_means(q.float(), num_qb)  # [qb, dim]
    k_blocks = _block_means(k.float(), num_kb)  # [kb, dim]
    last_q = torch.clamp(torch.arange(1, num_qb + 1, device=q.device) * BLOCK, max=num_q)
    reach = (q_start + last_q - 1) // BLOCK  # each query block's last visible key block
    key_block = torch.arange(num_kb, device=q.device)
    visible = key_block[None, :] <= reach[:, None]
    scores = (q_blocks @ k_blocks.T * scale).masked_fill(~visible, float("-inf"))
    scores[:, 0] = float("inf")
    scores[torch.arange(num_qb), reach] = float("inf")
    top = scores.topk(min(num_blocks, num_kb), dim=1).indices
    keep = torch.zeros(num_qb, num_kb, dtype=torch.bool, device=q.device)
    return keep.scatter_(1, top, True) & visible


def _block_means(x: torch.Tensor, num_blocks: int) -> torch.Tensor:
    padded = torch.nn.functional.pad(x, (0, 0, 0, num_blocks * BLOCK - x.shape[0]))
    sums = padded.view(num_blocks, BLOCK, -1).sum(1)
    counts = torch.clamp(x.shape[0] - torch.arange(num_blocks, device=x.device) * BLOCK,
                         max=BLOCK)  # fmt: skip
    return sums / counts[:, None]

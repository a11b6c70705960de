"""A step that carries a prompt piece and decode rows through the layers in one forward:
the resident tier attends the piece's rows over its sequence's pages and each decode row
over its own, as each would alone, against the fp32 reference."""

from __future__ import annotations

import pytest
import torch

from headspace.attention.reference import reference_attention
from headspace.kv.paged_store import PagedKVStore
from headspace.kv.spec import KVSpec
from headspace.tiers.base import StepInputs, block_table
from headspace.tiers.resident import ResidentTier

PAGE, DIM, KV_HEADS, Q_PER_KV = 4, 16, 2, 2
PIECE_PAGES, PREFIX = [3, 5, 7], 6  # the prompt's pages; its tokens before the piece
DECODE_PAGES, DECODE_POSITIONS = [[1, 2], [8, 9, 10]], [4, 8]  # the new token's position


def _store() -> PagedKVStore:
    """A one-layer store of 12 pages (and the scratch page), zeros."""
    store = PagedKVStore(KVSpec(1, KV_HEADS, DIM, PAGE, 4),
                         torch.zeros(2 * KV_HEADS * 13 * PAGE * DIM))  # fmt: skip
    store.layout([KV_HEADS], 12)
    return store


def _filled_store(generator: torch.Generator) -> tuple[PagedKVStore, dict]:
    """A store holding the prompt's prefix and each decoding
    sequence's tokens before its new one: the store and those K/V ``[2, kv_heads, tokens,
    dim]`` by sequence ("piece", 0, 1)."""
    store, held = _store(), {}
    decoding = zip((0, 1), DECODE_PAGES, DECODE_POSITIONS, strict=True)
    for name, pages, count in [("piece", PIECE_PAGES, PREFIX), *decoding]:
        kv = torch.randn(2, count, KV_HEADS, DIM, generator=generator)
        store.write(0, store.slots(torch.tensor(pages), torch.arange(count)), kv)
        held[name] = kv.transpose(1, 2)
    return store, held


def _steps() -> tuple[StepInputs, StepInputs]:
    piece = StepInputs(False, torch.arange(PREFIX, PREFIX + 4), [], {"gpu": [PIECE_PAGES]},
                       start=PREFIX, seq_ids=[7])  # fmt: skip
    positions = torch.tensor(DECODE_POSITIONS)
    tables = {"gpu": block_table(DECODE_PAGES, 8)}
    decode = StepInputs(True, positions, list(DECODE_POSITIONS), {"gpu": DECODE_PAGES}, tables,
                        positions + 1, seq_ids=[0, 1])  # fmt: skip
    return piece, decode


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_a_piece_and_decode_rows_attended_in_one_step_as_each_alone(backend):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(6, KV_HEADS * Q_PER_KV, DIM, generator=generator)  # 4 piece rows, 2 decode
    kv = torch.randn(2, 6, KV_HEADS, DIM, generator=generator)
    store, held = _filled_store(generator)
    tier = ResidentTier(store, [(0, KV_HEADS)], Q_PER_KV, backend)
    tier.begin_mixed(*_steps())
    out = torch.empty_like(q)
    tier.submit(0, q, kv, out)
    _, lse = tier.collect(0)  # [heads, rows]
    new = kv.transpose(1, 2)  # [2, kv_heads, rows, dim]
    keys = torch.cat([held["piece"], new[:, :, :4]], dim=2)
    want, want_lse = reference_attention(q[:4].transpose(0, 1), keys[0], keys[1], causal=True)
    torch.testing.assert_close(out[:4], want.transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:, :4], want_lse, atol=1e-5, rtol=1e-5)
    for row, seq in ((4, 0), (5, 1)):
        keys = torch.cat([held[seq], new[:, :, row : row + 1]], dim=2)
        want, want_lse = reference_attention(q[row : row + 1].transpose(0, 1), keys[0], keys[1])
        torch.testing.assert_close(out[row], want[:, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[:, row], want_lse[:, 0], atol=1e-5, rtol=1e-5)
    # the same rows attended in two steps, each alone: the same sums
    apart_store = _store()
    apart_store.kv[0].copy_(store.kv[0])  # (the new rows' K/V written again alike)
    apart = ResidentTier(apart_store, [(0, KV_HEADS)], Q_PER_KV, backend)
    piece, decode = _steps()
    apart_out = torch.empty_like(q)
    for step, rows in ((piece, slice(0, 4)), (decode, slice(4, 6))):
        apart.begin(step)
        apart.submit(0, q[rows], kv[:, rows], apart_out[rows])
        apart.collect(0)
    assert torch.equal(apart_out, out)

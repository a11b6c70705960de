"""Query-aware blocks of the hybrid tier's sparse mode: the key boxes' bound, their growth
block by block, and which positions a query picks."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headspace.tiers.hybrid_blocks import BLOCK, KeyBoxes, block_bounds, query_positions


def _keys(heads: int, tokens: int, dim: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(heads, tokens, dim, generator=generator)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 3), st.integers(1, 6), st.integers(1, 4), st.integers(0, 10_000))
def test_a_box_bounds_every_key_of_its_block(heads, blocks, group, seed):
    """``q . c + |q| . r`` is at least every query head's score of every key of the block,
    and equals the best one's when the block's keys are all alike."""
    keys = _keys(heads, blocks * BLOCK, 8, seed)
    q = _keys(heads, group, 8, seed + 1)
    boxes = KeyBoxes()
    centre, radius = boxes.grow(0, blocks * BLOCK, lambda a, b: keys[:, a:b])
    bound = block_bounds(q, centre, radius)  # [heads, blocks]
    scores = (q @ keys.transpose(1, 2)).view(heads, group, blocks, BLOCK).amax(3).amax(1)
    assert (bound >= scores - 1e-5).all()
    same = keys.view(heads, blocks, BLOCK, 8)[:, :, :1].expand(-1, -1, BLOCK, -1)
    centre, radius = KeyBoxes().grow(0, blocks * BLOCK, lambda a, b: same.flatten(1, 2)[:, a:b])
    exact = (q @ same.flatten(1, 2).transpose(1, 2)).view(heads, group, blocks, BLOCK)
    torch.testing.assert_close(block_bounds(q, centre, radius), exact.amax(3).amax(1))


def test_boxes_grown_block_by_block_equal_boxes_found_at_once():
    """The CPU side grows a page at a time: the boxes grown over several calls (ends that
    cut blocks included) equal those of the whole history, and a partial block waits."""
    keys = _keys(2, 100, 4, 0)
    read = []

    def reader(start: int, stop: int) -> torch.Tensor:
        read.append((start, stop))
        return keys[:, start:stop]

    grown = KeyBoxes()
    for end in (10, 37, 37, 64, 100):
        centre, radius = grown.grow(3, end, reader)
        assert centre.shape == (2, end // BLOCK, 4)
    at_once = KeyBoxes().grow(3, 100, lambda a, b: keys[:, a:b])
    torch.testing.assert_close(centre, at_once[0])
    torch.testing.assert_close(radius, at_once[1])
    read = [(a, b) for a, b in read if a < b]
    assert read == [(0, 32), (32, 64), (64, 96)]  # each key read once, whole blocks


def test_a_query_picks_the_blocks_along_it_and_the_tail():
    keys = _keys(1, 80, 4, 1) * 0.01
    keys[0, 48:64, 2] = 3.0  # block 3 lies along the query
    centre, radius = KeyBoxes().grow(0, 70, lambda a, b: keys[:, a:b])
    q = torch.zeros(1, 2, 4)
    q[0, 1, 2] = 1.0
    (positions,) = query_positions(q, centre, radius, 1, 70)
    assert positions.tolist() == list(range(48, 64)) + list(range(64, 70))
    (positions,) = query_positions(q, centre, radius, 0, 70)
    assert positions.tolist() == list(range(64, 70))  # no block: the tail alone
    (positions,) = query_positions(q, centre, radius, 99, 70)
    assert positions.tolist() == list(range(70))  # more blocks asked than there are

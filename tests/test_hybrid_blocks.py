"""Query-aware blocks of the hybrid tier's sparse mode: the key boxes' bound, their growth
block by block, which positions a query picks, and the host memory the boxes take."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headspace.tiers.hybrid_blocks import (
    BLOCK,
    KeyBoxes,
    block_bounds,
    box_bytes_per_kv_byte,
    full_blocks,
    query_positions,
)
from test_hybrid_sparse import _selector
from test_offload import make


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_boxes_take_the_share_of_the_keys_and_values_they_bound(dtype):
    """The boxes of 40 blocks of 8 kv heads take ``box_bytes_per_kv_byte`` of those
    tokens' K and V bytes: what the host budget leaves them."""
    keys = torch.randn(8, 40 * BLOCK, 128).to(dtype)  # [heads, tokens, dim]
    centre, radius = KeyBoxes().grow(0, 40 * BLOCK, lambda start, stop: keys[:, start:stop])
    kv_bytes = 2 * keys.nbytes
    assert centre.nbytes + radius.nbytes == kv_bytes * box_bytes_per_kv_byte(dtype.itemsize)


@pytest.mark.parametrize("query_blocks", [0, 16])
def test_host_pages_leave_room_for_the_boxes(tiny_llama, query_blocks):
    """With query blocks the host pages take 16/17 of ``host_memory`` (fp32 on the CPU), so
    pages and the boxes of their keys stay within it; without, all of it."""
    llm = make(tiny_llama, arena=700 * 1024, host_memory="64MB", offload="hybrid",
               gpu_window=16, cpu_sparsity=1.0, cpu_query_blocks=query_blocks)  # fmt: skip
    host = llm.engine.lanes.lane("offload").runner.host
    boxes = box_bytes_per_kv_byte(4) if query_blocks else 0.0
    assert host.budget == (64_000_000 * 16 // 17 if query_blocks else 64_000_000)
    assert 64_000_000 - 1 <= host.budget * (1 + boxes) <= 64_000_000


def test_query_blocks_join_the_kept_tokens_of_each_row():
    """With query-aware blocks a sparse row attends its kept tokens and the blocks whose key
    boxes bound highest for the step's query: a block of keys along the query's direction
    (none of whose tokens the moving averages kept) comes in, and so do the tokens after
    the last full block; each position once, and the next step's blocks replace them."""
    selector = _selector(query_blocks=1, window=8, page_size=4)
    selector.begin([7], [60], [0])
    state = selector.states[7]
    state.evicted_end = 52  # tokens 0..51 on the CPU side: 3 full blocks and 4 more
    state.base[0] = (52, {0: torch.tensor([1, 40], dtype=torch.int32),
                          1: torch.tensor([2], dtype=torch.int32)})  # fmt: skip
    selector.sparse, selector.seq_ids = [0], [7]
    dim, slots = 8, 64
    host_kv = torch.randn(2, 2, slots, dim) * 0.01  # [kv heads, 2, slots, dim]
    q = torch.zeros(1, 4, dim)  # [rows, 2 kv heads x 2 query heads, dim]
    q[0, :2, 0] = q[0, 2:, 1] = 1.0  # kv head 0's queries along dimension 0, head 1's 1
    pages = [list(range(16))]  # position p in slot p
    for head in range(2):  # each head: block 1 along dimension 0, block 2 along dimension 1
        host_kv[head, 0, BLOCK : 2 * BLOCK, 0] = 5.0
        host_kv[head, 0, 2 * BLOCK : 3 * BLOCK, 1] = 5.0
    tail = list(range(3 * BLOCK, 52))
    block = [range(BLOCK, 2 * BLOCK), range(2 * BLOCK, 3 * BLOCK)]
    for swap in (False, True):  # a later step (the kept tokens' table reused), other queries
        step_q = q[:, [2, 3, 0, 1]] if swap else q
        tables, counts = selector.token_tables(0, (0, 2), pages, slots, 4, step_q, host_kv)
        want = [{1, 40, *block[swap], *tail}, {2, *block[not swap], *tail}]
        for head, positions in enumerate(want):
            got = (tables[head, : counts[head]] - 2 * head * slots).tolist()
            assert sorted(got) == sorted(positions) and len(got) == len(positions)


def test_full_blocks_of_kept_positions():
    """A block counts as full only when every one of its tokens is kept."""
    kept = [torch.tensor([*range(BLOCK), 2 * BLOCK - 1, *range(2 * BLOCK, 3 * BLOCK)]),
            torch.tensor([], dtype=torch.int64)]  # fmt: skip
    assert full_blocks(kept, 3).tolist() == [[True, False, True], [False] * 3]
    assert full_blocks(kept, 2).tolist() == [[True, False], [False, False]]


def test_a_block_kept_whole_is_passed_over_at_every_step():
    """The block the query points at is kept whole already, so each step (the second from
    the cached table and its cached full blocks) brings in another block instead, and so
    does the step after the CPU side grows (the tables and full blocks found anew)."""
    selector = _selector(query_blocks=1, window=8, page_size=4)
    selector.begin([7], [60], [0])
    state = selector.states[7]
    state.evicted_end = 52  # 3 full blocks, then 4 tokens
    whole = torch.arange(BLOCK, 2 * BLOCK, dtype=torch.int32)
    state.base[0] = (52, {0: whole, 1: torch.tensor([2], dtype=torch.int32)})
    selector.sparse, selector.seq_ids = [0], [7]
    dim, slots = 8, 64
    host_kv = torch.randn(2, 2, slots, dim, generator=torch.Generator().manual_seed(1)) * 0.01
    host_kv[0, 0, BLOCK : 2 * BLOCK, 0] = 5.0  # kv head 0: block 1 along its query
    q = torch.zeros(1, 4, dim)
    q[0, :2, 0] = 1.0
    pages = [list(range(16))]
    for end in (52, 52, 56):
        if end != state.evicted_end:  # a page leaves the window: the tables are rebuilt
            state.evicted_end, state.version = end, state.version + 1
        tables, counts = selector.token_tables(0, (0, 2), pages, slots, 4, q, host_kv)
        got = set(tables[0, : counts[0]].tolist())
        assert len(got) == counts[0] == BLOCK + BLOCK + end % BLOCK
        assert set(whole.tolist()) <= got  # the kept block, once
        others = got - set(whole.tolist()) - set(range(end - end % BLOCK, end))
        assert len(others) == BLOCK and {p // BLOCK for p in others} <= {0, 2}


def test_full_blocks_are_found_once_per_table_and_anew_as_blocks_grow():
    """:func:`add_query_blocks` takes each sequence's full blocks from the table's cache
    where it holds them for the current block count (a block marked full there is passed
    over, whatever the kept positions say), and finds and stores them where the cache has
    none or an older count."""
    from types import SimpleNamespace

    from headspace.tiers.hybrid_blocks import add_query_blocks

    dim, slots, page = 8, 64, 4
    host_kv = torch.randn(1, 2, slots, dim, generator=torch.Generator().manual_seed(2)) * 0.01
    host_kv[0, 0, BLOCK : 2 * BLOCK, 0] = 5.0  # block 1 along the query
    q = torch.zeros(1, 2, dim)
    q[0, :, 0] = 1.0
    state = SimpleNamespace(evicted_end=48, boxes=KeyBoxes())
    kept = [torch.tensor([0], dtype=torch.int64)]

    def step(full: dict) -> set[int]:
        tables = torch.zeros(1, 64, dtype=torch.int32)
        counts = torch.tensor([1], dtype=torch.int32)
        count = add_query_blocks([(state, list(range(16)))], 0, (0, 1), slots, page, q,
                                 host_kv, (tables, counts, kept, full), 1)  # fmt: skip
        return set(tables[0, 1 : count[0]].tolist())

    full: dict = {}
    assert step(full) == set(range(BLOCK, 2 * BLOCK))  # block 1, the one along the query
    assert full[0].tolist() == [[False, False, False]]  # found and stored
    full[0] = torch.tensor([[False, True, False]])  # the cache says block 1 is kept whole
    assert {p // BLOCK for p in step(full)} <= {0, 2}  # so it is passed over
    state.evicted_end = 64  # a fourth block: the cached count is older, found anew
    assert step(full) == set(range(BLOCK, 2 * BLOCK)) and full[0].shape == (1, 4)


def test_query_blocks_over_shuffled_pages_of_two_sequences():
    """Two sequences in shuffled host pages, the layer's kv heads 1 and 2 of three: each
    (sequence, head) row gets the block along its own query, read from its own pages; after
    the CPU side grows (a page leaves the window), the new full block is boxed and picked."""
    selector = _selector(query_blocks=1, kv_heads={0: range(1, 3)}, num_kv_heads=3,
                         num_layers=1, window=8, page_size=8)  # fmt: skip
    selector.begin([7, 8], [100, 100], [0, 0])
    states = [selector.states[7], selector.states[8]]
    for state in states:
        state.evicted_end = 40  # blocks 0 and 1, tail 32..39
        state.base[0] = (40, {1: torch.tensor([3], dtype=torch.int32),
                              2: torch.tensor([], dtype=torch.int32)})  # fmt: skip
    selector.sparse, selector.seq_ids = [0, 1], [7, 8]
    page, dim = 8, 8
    pages = [[5, 0, 9, 2, 7, 11, 1, 3], [4, 10, 6, 12, 8, 13, 14, 15]]  # 8 pages each
    slots = 16 * page
    host_kv = torch.randn(3, 2, slots, dim, generator=torch.Generator().manual_seed(0)) * 0.01

    def plant(seq: int, head: int, block: int, along: int) -> None:
        for position in range(block * BLOCK, (block + 1) * BLOCK):
            slot = pages[seq][position // page] * page + position % page
            host_kv[head, 0, slot, along] = 5.0

    plant(0, 1, 1, 0)  # sequence 7, head 1: block 1 along dimension 0
    plant(0, 2, 0, 1)
    plant(1, 1, 0, 2)
    plant(1, 2, 2, 3)  # sequence 8, head 2: block 2, a full block only once the side grows
    q = torch.zeros(2, 4, dim)  # [sequences, 2 kv heads x 2 query heads, dim]
    q[0, :2, 0] = q[0, 2:, 1] = q[1, :2, 2] = q[1, 2:, 3] = 1.0

    def attended(tables, counts, row: int, head: int) -> list[int]:
        seq_pages = torch.tensor(pages[row // 2])
        got = tables[row, : counts[row]] - 2 * head * slots
        positions = [int((seq_pages == s // page).nonzero()) * page + s % page for s in got]
        assert len(set(positions)) == len(positions)
        return sorted(positions)

    tables, counts = selector.token_tables(0, (1, 3), pages, slots, page, q, host_kv)
    tail = list(range(32, 40))
    assert attended(tables, counts, 0, 1) == sorted({3, *range(16, 32), *tail})
    assert attended(tables, counts, 1, 2) == [*range(0, 16), *tail]
    assert attended(tables, counts, 2, 1) == [*range(0, 16), *tail]
    assert len(attended(tables, counts, 3, 2)) == 16 + len(tail)  # block 2 not full yet
    states[1].evicted_end, states[1].version = 48, states[1].version + 1  # a page leaves
    tables, counts = selector.token_tables(0, (1, 3), pages, slots, page, q, host_kv)
    assert attended(tables, counts, 3, 2) == list(range(32, 48))  # boxed, picked; no tail

"""Page pool and block tables: a worked example with exact page ids, and property tests."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from headspace.kv.block_table import BlockManager, OutOfPages
from headspace.kv.page_pool import PagePool


def test_worked_example_from_docs():
    """docs/paged_kv.md, step by step: page size 4, a pool of 6 pages."""
    blocks = BlockManager(num_pages=6, page_size=4)
    a = list(range(1, 11))  # 10 tokens
    assert blocks.allocate_prompt(0, a) == 0
    assert blocks.table(0).pages == [0, 1, 2]
    blocks.cache_full_pages(0, a)  # pages 0 and 1 are full: [1..4], [5..8]
    b = [*range(1, 9), 20, 21]
    assert blocks.allocate_prompt(1, b) == 8  # shares the first two pages of A
    assert blocks.table(1).pages == [0, 1, 3]
    assert blocks.pool.ref_counts == [2, 2, 1, 1, 0, 0]
    blocks.free(0)
    assert blocks.pool.ref_counts == [1, 1, 0, 1, 0, 0]
    blocks.free(1)
    assert list(blocks.pool._free) == [4, 5, 2, 3]
    assert list(blocks.pool._evictable) == [1, 0]  # tail first: evicted first
    c = list(range(30, 46))  # 16 tokens, no shared prefix
    assert blocks.allocate_prompt(2, c) == 0
    assert blocks.table(2).pages == [4, 5, 2, 3]
    with pytest.raises(OutOfPages):  # hit on page 0, but two more pages do not fit
        blocks.allocate_prompt(3, [1, 2, 3, 4, 50, 51, 52, 53, 60])
    assert blocks.pool.num_free == 2 and 3 not in blocks.tables
    assert blocks.allocate_prompt(3, [1, 2, 3, 4, 70]) == 4  # page 0 reused
    assert blocks.table(3).pages == [0, 1]  # page 1 evicted (LRU) and reused
    assert blocks.pool.num_free == 0 and blocks.pool.lookup(blocks.table(3).hashes[0]) == 0
    blocks.free(2)  # C's pages were never registered: back to the free list, tail first
    assert list(blocks.pool._free) == [3, 2, 5, 4]
    assert blocks.allocate_prompt(4, [*range(1, 9), 9]) == 4  # [5..8] was evicted
    assert blocks.table(4).pages == [0, 3, 2] and blocks.pool.ref_counts[0] == 2


def test_last_token_is_always_computed():
    blocks = BlockManager(num_pages=4, page_size=4)
    tokens = list(range(8))
    blocks.allocate_prompt(0, tokens)
    blocks.cache_full_pages(0, tokens)
    assert blocks.allocate_prompt(1, tokens) == 4  # page 2 of 2 is recomputed for the logits


def test_append_opens_a_page_when_the_last_is_full():
    blocks = BlockManager(num_pages=3, page_size=2)
    blocks.allocate_prompt(0, [5, 6])
    blocks.append_token(0)
    assert blocks.table(0).pages == [0, 1] and blocks.table(0).num_tokens == 3
    blocks.append_token(0)
    assert blocks.table(0).pages == [0, 1]


def test_fork_shares_full_pages_and_copies_the_partial_one():
    blocks = BlockManager(num_pages=6, page_size=4)
    blocks.allocate_prompt(0, list(range(6)))
    assert blocks.fork(0, 1) == (1, 2)
    assert blocks.table(1).pages == [0, 2]
    assert blocks.pool.ref_counts[:3] == [2, 1, 1]


def test_pool_rejects_empty_pool():
    with pytest.raises(ValueError):
        PagePool(0)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free sequences keep the pool consistent."""

    def __init__(self):
        super().__init__()
        self.blocks = BlockManager(num_pages=12, page_size=3)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    @rule(prefix=st.integers(0, 2), length=st.integers(1, 14), tail=st.integers(0, 3))
    def allocate(self, prefix, length, tail):
        tokens = ([prefix] * 6 + list(range(100, 120)))[:length] + [tail]
        try:
            self.blocks.allocate_prompt(self.next_id, tokens)
        except OutOfPages:
            return
        self.blocks.cache_full_pages(self.next_id, tokens)
        self.tokens[self.next_id] = tokens
        self.next_id += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def append(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        try:
            self.blocks.append_token(seq)
        except OutOfPages:
            return
        self.tokens[seq].append(7)
        self.blocks.cache_full_pages(seq, self.tokens[seq])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.blocks.pool.num_free == 0:
            return
        self.blocks.fork(seq, self.next_id)
        self.tokens[self.next_id] = list(self.tokens[seq])
        self.next_id += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.blocks.free(seq)
        del self.tokens[seq]

    @invariant()
    def ref_counts_equal_holders(self):
        holders = [0] * self.blocks.pool.num_pages
        for tables in self.blocks.tables.values():
            for table in tables.values():
                assert len(set(table.pages)) == len(table.pages), "page twice in one table"
                assert len(table.pages) == self.blocks.pages_for(table.num_tokens)
                for page in table.pages:
                    holders[page] += 1
        assert holders == self.blocks.pool.ref_counts

    @invariant()
    def every_page_is_in_exactly_one_place(self):
        pool = self.blocks.pool
        free, evictable = list(pool._free), list(pool._evictable)
        held = [p for p in range(pool.num_pages) if pool.ref_counts[p] > 0]
        assert sorted(free + evictable + held) == list(range(pool.num_pages))

    def teardown(self):
        for seq in list(self.tokens):
            self.blocks.free(seq)
        assert self.blocks.pool.num_free == self.blocks.pool.num_pages
        assert not any(self.blocks.pool.ref_counts)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)

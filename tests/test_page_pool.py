"""Page pool and block tables: a worked example with exact page ids, and property tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from headspace.errors import UserError
from headspace.kv.block_table import GPU, HOST, BlockManager, OutOfPages, PoolLayout
from headspace.kv.host_store import HostKVArena, HostLedger
from headspace.kv.page_pool import PagePool
from headspace.kv.spec import KVSpec


def test_worked_example_from_docs():
    """docs/paged_kv.md, step by step: page size 4, a pool of 6 pages."""
    blocks = BlockManager(page_size=4, num_gpu_pages=6)
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
    blocks = BlockManager(page_size=4, num_gpu_pages=4)
    tokens = list(range(8))
    blocks.allocate_prompt(0, tokens)
    blocks.cache_full_pages(0, tokens)
    assert blocks.allocate_prompt(1, tokens) == 4  # page 2 of 2 is recomputed for the logits


def test_append_opens_a_page_when_the_last_is_full():
    blocks = BlockManager(page_size=2, num_gpu_pages=3)
    blocks.allocate_prompt(0, [5, 6])
    blocks.append_token(0)
    assert blocks.table(0).pages == [0, 1] and blocks.table(0).num_tokens == 3
    blocks.append_token(0)
    assert blocks.table(0).pages == [0, 1]


def test_two_tiers_share_the_prefix_and_swap_round_trips():
    blocks = BlockManager(page_size=4, num_gpu_pages=6, num_host_pages=6)
    tokens = list(range(9))  # 3 pages
    assert blocks.allocate_prompt(0, tokens, (GPU, HOST)) == 0
    assert blocks.table(0, GPU).pages == [0, 1, 2] and blocks.table(0, HOST).pages == [0, 1, 2]
    blocks.cache_full_pages(0, tokens)
    assert blocks.allocate_prompt(1, [*tokens[:8], 50], (GPU, HOST)) == 8  # both tiers hit
    assert blocks.pools[HOST].ref_counts[:4] == [2, 2, 1, 1]
    blocks.free(1)
    blocks.free(0)
    blocks.allocate_prompt(2, list(range(20, 26)))  # GPU only: 2 pages
    gpu_pages = list(blocks.table(2, GPU).pages)
    pairs = blocks.swap_out(2)
    assert [gpu for gpu, _ in pairs] == gpu_pages and blocks.tiers(2) == [HOST]
    assert blocks.pools[GPU].num_free == 6  # its GPU pages are back
    back = blocks.swap_in(2)
    assert [host for host, _ in back] == [host for _, host in pairs]
    assert blocks.tiers(2) == [GPU] and blocks.table(2, GPU).num_tokens == 6
    assert blocks.pools[HOST].num_free == 6


def test_a_new_layout_keeps_swapped_out_sequences_and_attaches_them_to_both_tiers():
    """A layout change while sequences run: they swap out to host pages, the GPU pool is
    replaced, and each gets GPU pages beside its host pages (a layout that streams heads:
    both tiers hold it from then on), one GPU page per host page."""
    blocks = BlockManager(page_size=4, num_gpu_pages=6, num_host_pages=8)
    blocks.allocate_prompt(0, list(range(10)))  # 3 pages
    blocks.allocate_prompt(1, list(range(5)))  # 2 pages
    with pytest.raises(AssertionError):  # GPU pages held: the pool cannot change
        blocks.reset(PoolLayout(4))
    for seq in (0, 1):
        blocks.swap_out(seq)
    blocks.reset(PoolLayout(5))
    assert blocks.pool.num_pages == 5 and blocks.pools[HOST].num_free == 3
    pairs = blocks.attach(0) + blocks.attach(1)
    assert [h for h, _ in pairs] == blocks.table(0, HOST).pages + blocks.table(1, HOST).pages
    assert sorted(g for _, g in pairs) == list(range(5)) and blocks.pool.num_free == 0
    assert blocks.tiers(0) == [GPU, HOST] and blocks.table(0).num_tokens == 10
    blocks.append_token(1)  # 6 tokens: still two pages, in both tiers
    assert len(blocks.table(1).pages) == len(blocks.table(1, HOST).pages) == 2
    for seq in (0, 1):
        blocks.free(seq)
    assert blocks.pool.num_free == 5 and blocks.pools[HOST].num_free == 8


def test_grow_and_drop_cache():
    pool = PagePool(0)
    with pytest.raises(OutOfPages):
        pool.allocate()
    pool.grow(2)
    page = pool.allocate()
    pool.register(page, b"x")
    pool.release(page)
    assert pool.lookup(b"x") == page and pool.num_free == 2
    assert pool.num_kept == 1  # cached: its contents matter though no sequence holds it
    pool.drop_cache()
    assert pool.lookup(b"x") is None and pool.num_free == 2 and len(pool._free) == 2
    assert pool.num_kept == 0


def test_a_growing_pool_keeps_the_cached_pages_past_the_held_ones_in_what_moves():
    """A resident pool that grows keeps its unreferenced cached pages in the cache, so the
    bound of what its store moves to the new layout covers them too (else a later prompt
    reuses a page whose K/V stayed behind)."""
    blocks = BlockManager(page_size=4, num_gpu_pages=6)
    blocks.allocate_prompt(0, list(range(1, 5)))  # page 0, held
    blocks.allocate_prompt(1, list(range(10, 19)))  # pages 1-3; 1 and 2 full
    blocks.cache_full_pages(1, list(range(10, 19)))
    blocks.free(1)  # pages 1 and 2 cached, unreferenced
    assert blocks.resize_gpu(9) == ([], 3)  # pages 0 (held), 1 and 2 (cached) move
    assert blocks.allocate_prompt(2, list(range(10, 19))) == 8  # the cache still hits
    blocks.free(2)
    moves, bound = blocks.resize_gpu(4)  # shrinking forgets them: only held pages move
    assert (moves, bound) == ([], 1) and blocks.allocate_prompt(3, list(range(10, 19))) == 0


def _arena(budget_pages: int | None) -> tuple[HostKVArena, KVSpec]:
    spec = KVSpec(2, 2, 4, 8, 4)  # layers, kv heads, head dim, page size, bytes
    budget = None if budget_pages is None else budget_pages * spec.full_page_bytes
    return HostKVArena(spec, torch.float32, pin=False, budget=budget), spec


def test_host_arena_takes_spare_pages_and_copies_what_it_holds():
    arena, spec = _arena(None)
    assert arena.ensure(4) and arena.num_pages == 6  # half again, for requests that join
    assert arena.num_bytes == (6 + 1) * spec.full_page_bytes  # + the scratch page
    assert not arena.ensure(6)
    arena.data.uniform_()
    held = arena.data.clone()
    assert arena.ensure(7) and arena.num_pages == 10
    assert arena.generation == 2 and torch.equal(arena.data[..., : held.shape[3], :], held)


def test_host_arena_counts_both_arenas_while_it_copies():
    """A copy holds the old arena and the new one at once: both must fit the budget (a
    512K prompt's 64 GiB arena growing by half would otherwise ask 160 GiB of a 128 GiB
    machine); when no page holds data the old one is freed first."""
    arena, spec = _arena(20)
    arena.ensure(10)
    assert arena.num_pages == 15  # half again: 15 + scratch fit 20 pages
    with pytest.raises(UserError, match="beside the .* arena they are copied from"):
        arena.ensure(16)  # 16 + 1 new beside 16 old pages
    assert arena.num_pages == 15 and arena.data is not None  # unchanged
    assert arena.ensure(16, keep=False) and arena.num_pages == 19  # capped by the budget
    assert float(arena.data.abs().sum()) == 0.0
    with pytest.raises(UserError, match="more than the .* host budget"):
        arena.ensure(20, keep=False)


def test_arenas_sharing_a_ledger_leave_what_the_others_hold_and_go_by_reference_counts():
    """Two arenas (two lanes) share one host budget: each may hold what the other leaves;
    one dropped frees its memory at once, with the collector off (a server's heap is
    frozen after its warm-up), and the other may then hold the whole budget."""
    import gc
    import weakref

    spec = KVSpec(2, 2, 4, 8, 4)
    ledger = HostLedger(20 * spec.full_page_bytes)
    first = HostKVArena(spec, torch.float32, pin=False, budget=ledger)
    second = HostKVArena(spec, torch.float32, pin=False, budget=ledger)
    first.ensure(10)  # 15 pages + scratch
    assert second.budget == 4 * spec.full_page_bytes
    gone = weakref.ref(first)
    gc.disable()
    try:
        del first
        assert gone() is None  # no cycle through the ledger
    finally:
        gc.enable()
    assert second.budget == 20 * spec.full_page_bytes


def test_a_claimed_growth_keeps_its_bytes_from_the_other_lanes_until_it_is_made():
    """Lanes schedule on their own threads and grow their arenas a moment later: a growth a
    lane's scheduler planned claims its bytes at once, so the other lane can no longer plan
    them (before claims, both plans passed and the later growth stopped the engine); the
    claim ends when the growth is made or refused."""
    spec = KVSpec(2, 2, 4, 8, 4)
    page = spec.full_page_bytes
    ledger = HostLedger(20 * page)
    first = HostKVArena(spec, torch.float32, pin=False, budget=ledger)
    second = HostKVArena(spec, torch.float32, pin=False, budget=ledger)
    assert first.claim(10)  # 10 pages + scratch claimed
    assert second.budget == 9 * page
    assert not second.claim(9)  # 9 pages need a scratch page too
    assert second.claim(8) and second.ensure(8)  # within what the claim leaves
    assert first.ensure(10) and first.num_pages == 10  # the growth planned first is made
    assert first.claimed == 0 and second.claimed == 0
    assert not first.claim(11) and not second.claim(9)  # the budget is spent
    with pytest.raises(UserError, match="host budget"):
        second.ensure(12)
    assert second.claimed == 0 and second.num_pages == 8  # refused: nothing held back


def test_a_claim_counts_the_old_arena_only_while_its_pages_are_copied():
    """A growth that keeps the arena's pages needs the old arena beside the new one; one
    that frees it first (nothing in it matters, or new rows) needs only the new one."""
    spec = KVSpec(2, 2, 4, 8, 4)
    page = spec.full_page_bytes
    arena = HostKVArena(spec, torch.float32, pin=False, budget=HostLedger(30 * page))
    arena.ensure(10, keep=False)  # half again: 15 pages + scratch
    assert arena.num_pages == 15 and arena.claim(15) and arena.claimed == 0  # held already
    assert not arena.claim(20)  # 16 held + 21 new > 30
    assert arena.claim(20, keep=False) and arena.claimed == 21 * page
    assert arena.ensure(20, keep=False) and arena.claimed == 0
    assert arena.claim(9, rows=1) and arena.claimed == 10 * spec.host_page_bytes(1)
    arena.ensure(9, keep=False, rows=1)
    assert arena.rows == 1 and arena.claimed == 0


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / append / swap out / swap in / free sequences over both tiers keep
    both pools consistent."""

    def __init__(self):
        super().__init__()
        self.blocks = BlockManager(page_size=3, num_gpu_pages=12, num_host_pages=10)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    @rule(prefix=st.integers(0, 2), length=st.integers(1, 14), tail=st.integers(0, 3),
          both=st.booleans())  # fmt: skip
    def allocate(self, prefix, length, tail, both):
        tokens = ([prefix] * 6 + list(range(100, 120)))[:length] + [tail]
        tiers = (GPU, HOST) if both else (GPU,)
        try:
            self.blocks.allocate_prompt(self.next_id, tokens, tiers)
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
    def swap(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        tiers = self.blocks.tiers(seq)
        try:
            if tiers == [GPU]:
                pairs = self.blocks.swap_out(seq)
            elif tiers == [HOST]:
                pairs = self.blocks.swap_in(seq)
            else:
                return
        except OutOfPages:
            assert self.blocks.tiers(seq) == tiers  # refused: nothing moved
            return
        assert len(pairs) == self.blocks.pages_for(len(self.tokens[seq]))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.blocks.free(seq)
        del self.tokens[seq]

    @invariant()
    def ref_counts_equal_holders(self):
        for tier, pool in self.blocks.pools.items():
            holders = [0] * pool.num_pages
            for seq, tables in self.blocks.tables.items():
                if tier not in tables:
                    continue
                table = tables[tier]
                assert len(set(table.pages)) == len(table.pages), "page twice in one table"
                assert len(table.pages) == self.blocks.pages_for(table.num_tokens)
                assert table.num_tokens == len(self.tokens[seq])
                for page in table.pages:
                    holders[page] += 1
            assert holders == pool.ref_counts

    @invariant()
    def every_page_is_in_exactly_one_place(self):
        for pool in self.blocks.pools.values():
            free, evictable = list(pool._free), list(pool._evictable)
            held = [p for p in range(pool.num_pages) if pool.ref_counts[p] > 0]
            assert sorted(free + evictable + held) == list(range(pool.num_pages))

    def teardown(self):
        for seq in list(self.tokens):
            self.blocks.free(seq)
        for pool in self.blocks.pools.values():
            assert pool.num_free == pool.num_pages and not any(pool.ref_counts)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)

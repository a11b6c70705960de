"""Streaming heads over long prompts: while a prompt is prefilled, each streaming entry holds
its sink pages and a ring that later prompt pages overwrite (``kv.spec.prefill_ring``), its
chunks attend only the keys they see, the planner prices that, host pages hold only the
offloaded entries' rows, and decode's device tables grow with what runs. End-to-end
equality with an independent masked model is in ``test_streaming_heads`` and
``test_pattern_matrix`` (their prompts wrap the rings)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from headspace.errors import UserError
from headspace.kv.block_table import PoolLayout
from headspace.kv.entry_table import EntryBlockManager
from headspace.kv.host_store import HostKVArena
from headspace.kv.spec import KVSpec, prefill_ring
from headspace.model.config import config_from_dict
from headspace.planner.context import PlanRequest, make_plan
from headspace.planner.sparsity import gathered_bytes, prefill_gathers
from headspace.tiers.entry_slots import EntrySlots, check_rings, ring_keys
from headspace.tiers.entry_tables import EntryTables

GiB = 2**30


def test_the_ring_holds_every_page_a_chunk_writes_or_reads():
    """Over a whole prompt, chunk by chunk: the pages from the window before a chunk to its
    end lie in distinct ring pages, and no later chunk overwrites what an earlier page
    needed before that chunk ran."""
    page, sink, window, chunk = 16, 4, 40, 64
    sink_pages, ring_pages = prefill_ring(page, sink, window, chunk)
    assert (sink_pages, ring_pages) == (1, 8)

    def column(p: int) -> int:
        return p if p < sink_pages else sink_pages + (p - sink_pages) % ring_pages

    for start in range(0, 2000, chunk):
        seen = range(max(0, start - window) // page, (start + chunk - 1) // page + 1)
        columns = [column(p) for p in seen]
        assert len(set(columns)) == len(columns) and max(columns) < sink_pages + ring_pages


def _blocks(num_entries: int, rings: tuple, pages: int = 200) -> EntryBlockManager:
    blocks = EntryBlockManager(16, 0, num_entries)
    blocks.reset(PoolLayout(pages, rings=rings))
    return blocks


def test_ring_entries_take_their_ring_for_the_prompt_and_unwrap_when_compressed():
    blocks = _blocks(3, ((1, 1, 8),))  # entry 1: a sink page and 8 ring pages
    assert blocks.pages_for(420) == 27 + 9 + 27  # 420 tokens: 27 pages a full entry
    blocks.allocate_prompt(0, list(range(420)))
    lists = blocks.entries[0]
    assert [len(p) for p in lists.pages] == [27, 9, 27] and lists.wraps == {1: (1, 8)}
    assert blocks.pool.num_free == 200 - 63
    with pytest.raises(ValueError, match="wrapped"):
        blocks.compress(0, [420, 420, 420])
    blocks.compress(0, [420, 44, 420], rings={1: (4, 40)})
    assert lists.wraps == {} and [len(p) for p in lists.pages] == [27, 3, 27]
    short = _blocks(2, ((0, 1, 8),))
    short.allocate_prompt(0, list(range(100)))  # 7 pages: no wrap
    assert short.entries[0].wraps == {} and [len(p) for p in short.entries[0].pages] == [7, 7]


def test_entry_slots_follow_the_ring_and_check_the_chunk():
    blocks = _blocks(2, ((1, 1, 8),))
    blocks.allocate_prompt(0, list(range(420)))
    lists = blocks.entries[0]
    slots = EntrySlots(lists, [0, 2], 420, 16, torch.device("cpu"))[0]  # [2, positions]
    positions = torch.arange(420)
    assert torch.equal(
        slots[0], torch.tensor(lists.pages[0])[positions // 16] * 16 + positions % 16
    )
    ring = lists.pages[1]
    for p in (0, 15, 16, 143, 144, 300, 419):  # page 9 lies where page 1 did
        column = p // 16 if p < 16 else 1 + (p // 16 - 1) % 8
        assert slots[1, p] == ring[column] * 16 + p % 16
    check_rings(lists, {1: (4, 40)}, 64, 16)
    with pytest.raises(RuntimeError, match="prefill ring"):
        check_rings(lists, {1: (4, 40)}, 65 + 16, 16)


def test_a_streaming_chunk_sees_the_sink_the_window_and_itself_renumbered():
    plane = torch.arange(2 * 500 * 1, dtype=torch.float32).view(2, 500, 1)
    slots = torch.arange(300).view(1, 300)  # position p in slot p
    kv = torch.full((2, 20, 1, 1), -1.0)
    keys, num_keys = ring_keys(plane, kv, slots, torch.tensor([0]), 280, 4, 40)
    assert num_keys == 4 + 40 + 20 and keys.shape[2] == 128  # padded to a block
    want = [*range(4), *range(240, 280)]
    assert keys[0, 0, :44, 0].tolist() == [float(p) for p in want]
    assert (keys[:, 0, 44:64] == -1).all() and (keys[:, 0, 64:] == 0).all()
    early, count = ring_keys(plane, kv, slots, torch.tensor([0]), 30, 4, 40)
    assert count == 50 and early[0, 0, :30, 0].tolist() == [float(p) for p in range(30)]


LLAMA3_8B_2M = config_from_dict({
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 2**21,
    "rms_norm_eps": 1e-5, "rope_theta": 3.6e9, "tie_word_embeddings": False,
})  # fmt: skip


def _scores(per_layer: list[int]) -> tuple:
    """Retrieval scores with ``per_layer[layer]`` high heads in each layer."""
    return tuple(tuple(0.9 if h < n else 0.1 * h / 8 for h in range(8)) for n in per_layer)


def test_two_million_tokens_of_streaming_heads_plan_within_24_gib():
    """Llama-3.1-8B's shape at 2M tokens, two retrieval heads a layer (a quarter): the
    streaming heads hold their rings, the retrieval heads go to host pages of two rows a
    layer (64 GiB, not the 256 GiB of every entry), and a layer's prefill gathers a piece of
    the prefix, not its 24 GiB of keys. With three retrieval heads in some layer, staging
    them for decode does not fit: refused in one line."""
    request = PlanRequest(2**21, 24 * GiB, 100 * GiB, 2, "auto", retrieval=_scores([2] * 32),
                          retrieval_heads=0.25)  # fmt: skip
    plan = make_plan(LLAMA3_8B_2M, request)
    memory = plan.memory
    assert plan.offload == "head" and plan.head_map.num_offloaded == 64 and plan.host_rows == 2
    assert plan.ring_chunk == plan.prefill_chunk > 0
    budgeted = PlanRequest(2**15, 24 * GiB, 100 * GiB, 2, "auto", budget_tokens=2**12,
                           retrieval=_scores([2] * 32), retrieval_heads=0.25)  # fmt: skip
    assert make_plan(LLAMA3_8B_2M, budgeted).ring_chunk == 0  # budgets score every token
    assert memory["total_gpu"] <= 24 * GiB and memory["gathered"] < GiB
    assert memory["total_host"] == (plan.num_host_pages) * 32 * 2 * 128 * 512  # 64 GiB
    assert 63 * GiB < memory["total_host"] < 65 * GiB
    everything = gathered_bytes(8, 4, 128, 2, 2**21)
    assert everything > 23 * GiB  # what the layer would gather without the rings' path
    assert (
        prefill_gathers(8, 4, 128, 2, 2**21, 8192, budgets=True, pattern="streaming(4,1024)")
        == everything
    )  # budgets score all
    uneven = PlanRequest(2**21, 24 * GiB, 100 * GiB, 2, "auto",
                         retrieval=_scores([3, 1] * 16), retrieval_heads=0.25)  # fmt: skip
    with pytest.raises(UserError, match="stage"):
        make_plan(LLAMA3_8B_2M, uneven)


def test_host_pages_hold_the_rows_asked_and_start_anew_when_that_changes():
    spec = KVSpec(3, 4, 8, 16, 4)
    arena = HostKVArena(spec, torch.float32, pin=False, budget=None)
    assert arena.rows == 4 and arena.page_bytes == spec.full_page_bytes
    assert arena.ensure(10, keep=False, rows=2)
    assert arena.data.shape[:2] == (3, 2) and arena.page_bytes == spec.full_page_bytes // 2
    assert not arena.ensure(10, keep=True, rows=2)  # the same rows: nothing to do
    arena.ensure(4, keep=False, rows=1)
    assert arena.data.shape[:2] == (3, 1) and arena.num_pages >= 4
    budgeted = HostKVArena(spec, torch.float32, pin=False, budget=11 * spec.full_page_bytes)
    budgeted.ensure(20, keep=False, rows=2)  # 20 pages of half a full page fit
    with pytest.raises(UserError, match="host budget"):
        budgeted.ensure(30, keep=True)


def test_decode_tables_take_a_row_per_slot_in_use_and_grow_with_the_pages():
    blocks = EntryBlockManager(4, 200, 2)
    blocks.allocate_prompt(0, list(range(10)))  # 3 pages an entry
    blocks.allocate_prompt(1, list(range(30)))  # 8
    tables = EntryTables(2, 129, torch.device("cpu"))
    versions = [tables.version]
    assert tables.tables.shape == (1, 2, 8)  # the empty row, MIN_WIDTH columns
    tables.update(blocks, [0], [127])
    assert tables.tables.shape[0] == 2 and tables.slot_row[127] == 1
    widest = tables.update(blocks, [0, 1], [127, 5])
    assert widest == 8 and tables.tables.shape == (4, 2, 8)  # rows doubled
    got, lengths, _ = tables.rows(torch.tensor([5, 127, 0]), 16)  # slot 0: no row
    for i, seq in enumerate([1, 0]):
        pages = blocks.entries[seq].pages
        for e in range(2):
            assert got[i, e, : len(pages[e])].tolist() == pages[e]
            assert not got[i, e, len(pages[e]) :].any()
    assert lengths.tolist() == [[30, 30], [10, 10], [0, 0]] and not got[2].any()
    for _ in range(6):
        blocks.append_token(1)
    tables.update(blocks, [1], [5])  # the pages decode added: one more column
    assert tables.tables.shape[2] == 16
    assert tables.rows(torch.tensor([5]), 16)[0][0, 0, 8] == blocks.entries[1].pages[0][8]
    versions.append(tables.version)
    # under torchrun every rank grows to the widest rank's width, at the same step
    assert tables.update(blocks, [1], [5], agree=lambda widest: 40) == 40
    assert tables.tables.shape[2] == 40
    versions.append(tables.version)
    assert len(set(versions)) == 3  # each growth a new version; a new object never an old one
    assert EntryTables(2, 129, torch.device("cpu")).version not in versions
    # a sequence that ends gives its row back: its slot reads the empty row, the lowest
    # free row goes to the next slot, and a growth keeps only the rows in use
    tables.release(0)
    assert tables.slot_row[127] == 0 and tables.rows(torch.tensor([127]), 8)[1].sum() == 0
    blocks.allocate_prompt(2, list(range(200)))  # 50 pages
    tables.update(blocks, [2], [9])
    assert tables.slot_row[9] == 1 and tables.tables.shape == (3, 2, 80)  # rows 1, 2 in use
    assert tables.rows(torch.tensor([5]), 8)[1].tolist() == [[36, 36]]  # sequence 1 kept


def test_copies_of_full_heads_are_planned_whole_beside_the_rings():
    """A rank's part: its own heads (a full one, a streaming one) and a copy of the full
    one, whose pages the plan counts whole (a ring's would leave the copy no room)."""
    from headspace.planner.entry_offload import plan_entries
    from headspace.planner.head_map import HeadMap

    spec = KVSpec(2, 2, 8, 16, 4)
    entries = HeadMap.all_gpu(2, 2).entries
    streaming = [replace(e, pattern="streaming(4,16)") if e.kv_head else e for e in entries]
    head_map = HeadMap(2, 2, streaming)
    per_entry, ring = spec.pages_for(4096), sum(prefill_ring(16, 4, 16, 64))
    parts = [(3 * 2, [[0, 1], [0, 1]])]  # per layer: own heads 0 and 1, one copy
    plane = 2 * (2 * per_entry + ring) + 1  # two full entries and a ring a layer
    arena = plane * spec.entry_page_bytes
    plan = plan_entries(spec, arena, head_map, [4096], [4096], parts=parts, ring_chunk=64)
    assert plan.offload == "none"
    with pytest.raises(UserError, match="offload"):  # a page short, nothing may go
        plan_entries(spec, arena - spec.entry_page_bytes, head_map, [4096], [4096],
                     offload="none", parts=parts, ring_chunk=64)  # fmt: skip

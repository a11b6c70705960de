"""The hybrid tier's GPU window kept in GPU pages (HGCA): the same logits as staging it from
host pages every step, as pages leave the window, for windows of one page to the whole
history; what crosses to the GPU per step shrinks by the window."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import plan_of
from headspace import SamplingParams, UserError
from headspace.engine.hooks import EngineHooks
from headspace.kv.host_store import HostKVArena
from headspace.kv.spec import KVSpec
from headspace.planner.plan import gpu_window_pages, plan_batch
from headspace.tiers.hybrid_window import GpuWindow
from test_hybrid import decode_logits
from test_offload import PAGE, _prompts, make


def _counters(llm):
    """What the offload lane's tiers copied so far."""
    from types import SimpleNamespace

    return SimpleNamespace(**llm.engine.load().lane("offload").counters)


@pytest.mark.parametrize(
    "arena_kib,options",
    [
        (700, {"cpu_share": 1.0, "gpu_window": PAGE}),  # one page: one leaves every 16 steps
        (700, {"cpu_share": 1.0, "gpu_window": 3 * PAGE + 5}),
        (700, {"cpu_share": 0.5, "gpu_window": 2 * PAGE}),  # pages stream between CPU and it
        (900, {"cpu_share": 1.0, "gpu_window": 6 * PAGE}),  # half the history and more
    ],
)
def test_window_on_gpu_gives_the_logits_of_staging_it(wide_llama, prompt, cpu_timings,
                                                      arena_kib, options):  # fmt: skip
    staged = make(wide_llama, arena=arena_kib * 1024, offload="hybrid", window_on_gpu=False,
                  **options)  # fmt: skip
    kept = make(wide_llama, arena=arena_kib * 1024, offload="hybrid",
                hooks=EngineHooks(cpu_timings=cpu_timings), **options)  # fmt: skip
    gap = decode_logits(kept, prompt, 64) - decode_logits(staged, prompt, 64)
    assert gap.abs().max().item() < 1e-4  # every decode step, 150 to 214 tokens
    plan = plan_of(kept)
    assert plan.gpu_window is not None and plan_of(staged).gpu_window is None
    shares = {llm.engine.load().lane("offload").cpu_share for llm in (kept, staged)}
    assert shares == {options["cpu_share"]}  # the view's: the share asked for, in force
    assert plan.head_map.count("hybrid") > 0
    ours, theirs = _counters(kept), _counters(staged)
    assert ours.window_fill_pages > 0  # filled once from host pages
    # what crossed to the GPU for each hybrid entry, over the prompt's 64 decode steps
    per_entry = [
        (c.staged_entry_pages + c.window_fill_pages) / llm_plan.head_map.count("hybrid")
        for c, llm_plan in ((ours, plan), (theirs, plan_of(staged)))
    ]
    assert per_entry[0] < per_entry[1]
    assert sum(call.tokens for call in cpu_timings.calls) > 0


def test_only_the_older_part_streams_once_the_window_is_filled(wide_llama, prompt):
    """With the CPU taking all before the window, a step stages nothing: after the first
    step's fill, only the query and the CPU's result cross to the GPU."""
    llm = make(wide_llama, arena=700 * 1024, offload="hybrid", cpu_share=1.0, gpu_window=40)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    llm.generate(prompt, params)
    filled = _counters(llm).window_fill_pages
    hybrid = plan_of(llm).head_map.count("hybrid")
    assert filled == hybrid * (-(-150 // PAGE) - (150 - 40) // PAGE)  # pages 6..9, once
    llm.generate(prompt, params)
    counters = _counters(llm)
    assert counters.staged_entry_pages == 0
    assert counters.window_fill_pages == 2 * filled  # one fill per request, not per step


def test_a_batch_equals_one_at_a_time(wide_llama, cpu_timings):
    """Two sequences decode together, each in its own row of rings, then one alone."""
    prompts = _prompts([150, 100])
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    resident = make(wide_llama)
    expected = [resident.generate(p, params)[0].token_ids for p in prompts]
    llm = make(wide_llama, arena=700 * 1024, offload="hybrid", cpu_share=1.0, gpu_window=16,
               hooks=EngineHooks(cpu_timings=cpu_timings))  # fmt: skip
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert _counters(llm).window_fill_pages > 0  # each sequence's rings filled
    assert _counters(llm).staged_entry_pages == 0  # and no window staged


def test_sparse_mode_selects_the_same_with_the_window_on_gpu(wide_llama, prompt):
    """Approximate, so compared over the same head map: the staged run's budget is smaller
    by the window's pages."""
    options = {"offload": "hybrid", "cpu_share": 1.0, "gpu_window": 2 * PAGE,
               "cpu_sparsity": 1.0}  # fmt: skip
    kept = make(wide_llama, arena=700 * 1024, **options)
    kept_logits = decode_logits(kept, prompt, 48)
    plan = plan_of(kept)
    staged = make(wide_llama, arena=700 * 1024 - plan.gpu_window.num_bytes,
                  window_on_gpu=False, **options)  # fmt: skip
    gap = kept_logits - decode_logits(staged, prompt, 48)
    assert plan_of(staged).head_map == plan.head_map
    assert gap.abs().max().item() < 1e-4
    assert _counters(kept).window_fill_pages > 0


def _window(rows: int, ring_pages: int = 4) -> GpuWindow:
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype_bytes=4)
    host = HostKVArena(spec, torch.float32, pin=False, budget=None)
    host.ensure(24)
    host.data.copy_(torch.randn(host.data.shape, generator=torch.Generator().manual_seed(0)))
    pages = [torch.zeros(2, 1, rows * ring_pages * 4, 4) for _ in range(2)]
    return GpuWindow(pages, [1, 1], [1, 1], ring_pages, window=8, host=host)


def test_rings_fill_once_and_rows_pass_to_new_sequences():
    window = _window(rows=2)
    host_pages = [list(range(10)), list(range(10, 20))]
    # 21 tokens before the new one, the CPU up to page 2: the window from page (21-8)//4 = 3
    assert window.begin([7, 8], [21, 9], host_pages, [2, 0]) == [3, 0]
    assert window.fill(0) == 3 + 3  # pages 3..5 of the first, 0..2 of the second
    ring = window.pages[0][:, 0].unflatten(1, (-1, 4))  # [2, ring pages, 4, dim]
    host = window.host.layer(0)[1].unflatten(1, (-1, 4))  # [2, pages, 4, dim]
    row = window.row_of[7] * 4
    assert torch.equal(ring[:, row + 3 % 4], host[:, 3])  # page 3 in ring page 3
    assert torch.equal(ring[:, row + 5 % 4], host[:, 5])  # page 5 in ring page 1
    assert window.piece.lengths.tolist() == [22 - 12, 10]  # new token included
    # the next step: nothing to fill; a length that differs is filled again
    window.begin([7, 8], [22, 9], host_pages, [2, 0])
    assert window.fill(0) == 3  # the second sequence's length did not move
    # a third sequence takes the row of one that is not in the step
    assert window.begin([9, 7], [5, 23], host_pages, [0, 2]) is not None
    assert set(window.row_of) == {9, 7} and window.fill(0) == 2  # 9's pages 0..1
    # more sequences than rows: the window is staged this step, and refilled after
    assert window.begin([7, 9, 10], [24, 6, 3], host_pages + [[20]], [2, 0, 0]) is None
    assert window.piece is None and 7 not in window.held


def test_a_span_wider_than_the_rings_stages_the_window():
    """Rings sized for a short context (3 pages) and a window of 8 pages: a longer
    sequence's window would wrap onto itself, so the step stages it."""
    window = _window(rows=1, ring_pages=3)
    window.window = 32
    host_pages = [list(range(10))]
    assert window.begin([1], [9], host_pages, [0]) == [0]  # pages 0..2: they fit
    assert window.begin([1], [12], host_pages, [0]) is None  # pages 0..3 would not
    assert window.piece is None and 1 not in window.held


def test_a_window_longer_than_the_history_holds_all_of_it():
    window = _window(rows=1, ring_pages=3)  # a window of 8 tokens: at most 3 pages
    host_pages = [list(range(10))]
    assert window.begin([1], [6], host_pages, [0]) == [0]  # 6 tokens: all in the window
    assert window.fill(1) == 2 and window.piece.lengths.tolist() == [7]
    assert window.piece.offsets.tolist() == [0]


def test_the_planner_keeps_the_window_beside_the_staging():
    spec = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, page_size=128, dtype_bytes=2)
    arena, pages = 8 * 2**30, 1024  # 128K tokens
    off = plan_batch(spec, arena, pages, offload="hybrid", cpu_share=0.5, gpu_window=1024)
    on = plan_batch(spec, arena, pages, offload="hybrid", cpu_share=0.5, gpu_window=1024,
                    window_on_gpu=True)  # fmt: skip
    assert off.gpu_window is None and on.gpu_window is not None
    offloaded = max(sum(e.tier != "gpu" for e in on.head_map.layer(layer))
                    for layer in range(32))  # fmt: skip
    assert on.gpu_window == gpu_window_pages(spec, 1024, 1, offloaded)  # 8 pages + 2
    assert on.gpu_window.pages == 1024 // 128 + 1
    used = on.staging.num_bytes + on.gpu_window.num_bytes
    resident = on.head_map.count("gpu") * spec.entry_page_bytes * (on.num_gpu_pages + 1)
    assert used + resident <= arena  # the window's pages come out of the arena
    assert on.head_map.count("gpu") <= off.head_map.count("gpu")


@settings(max_examples=60, deadline=None)
@given(arena_mib=st.integers(64, 4096), window=st.sampled_from([128, 1024, 4096, 32768]),
       num_seqs=st.integers(1, 4), total_pages=st.integers(64, 4096))  # fmt: skip
def test_the_window_never_leaves_resident_heads_short_of_pages(arena_mib, window, num_seqs,
                                                               total_pages):  # fmt: skip
    spec = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, page_size=128, dtype_bytes=2)
    arena = arena_mib * 2**20
    try:
        plan = plan_batch(spec, arena, total_pages, offload="hybrid", cpu_share=0.5,
                          gpu_window=window, num_seqs=num_seqs, window_on_gpu=True)  # fmt: skip
    except UserError:
        return  # too small a budget for any staging: refused with the numbers
    if plan.staging is None:  # all resident: no window to keep
        assert plan.offload == "none" and plan.gpu_window is None
        return
    held = plan.staging.num_bytes + (plan.gpu_window.num_bytes if plan.gpu_window else 0)
    resident = plan.head_map.count("gpu")
    assert held + resident * spec.entry_page_bytes * (plan.num_gpu_pages + 1) <= arena
    assert resident == 0 or plan.num_gpu_pages >= total_pages
    if plan.gpu_window is not None:
        offloaded = max(sum(e.tier != "gpu" for e in plan.head_map.layer(layer))
                        for layer in range(32))  # fmt: skip
        assert plan.gpu_window.heads == offloaded
        assert plan.gpu_window.num_bytes <= arena // 2

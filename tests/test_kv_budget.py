"""KV budgets in per-head pages: the entry page lists (every page returns), decode over rows
of per-head lengths against the reference, compression keeping exactly the policy's tokens,
and the engine end to end (a budget covering the prompt equals the exact run)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import plan_of
from headspace import SamplingParams, UserError
from headspace.attention.entry_decode import entry_decode
from headspace.attention.reference import reference_attention
from headspace.budgets import POLICIES, KVBudget, kept_positions, observation_scores
from headspace.engine.hooks import EngineHooks
from headspace.kv.block_table import PoolLayout
from headspace.kv.entry_table import EntryBlockManager
from headspace.kv.page_pool import OutOfPages
from headspace.kv.spec import KVSpec
from headspace.model.config import load_config
from headspace.tiers.base import TierSite
from headspace.tiers.budget import BudgetTier, EntryLayout
from test_hybrid import decode_logits
from test_offload import PAGE, _prompts, make

# -- entry page lists -----------------------------------------------------------------------

actions = st.lists(st.tuples(st.sampled_from(["admit", "append", "compress", "free"]),
                             st.integers(0, 3), st.integers(1, 40)), max_size=40)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(actions, st.sampled_from([(), (1,), (0, 2)]))
def test_entry_pages_are_disjoint_sized_by_length_and_all_return(steps, offloaded):
    page_size, num_entries, num_pages, num_host = 4, 3, 60, 30
    blocks = EntryBlockManager(page_size, num_pages, num_entries)
    blocks.reset(PoolLayout(num_pages, offloaded=offloaded))
    blocks.grow_host(num_host)
    live = set()
    for action, seq_id, count in steps:
        try:
            if action == "admit" and seq_id not in live:
                blocks.allocate_prompt(seq_id, list(range(count)))
                live.add(seq_id)
            elif action == "append" and seq_id in live:
                blocks.append_token(seq_id)
            elif action == "compress" and seq_id in live:
                lengths = blocks.entries[seq_id].lengths
                blocks.compress(seq_id, [min(count + e, n) for e, n in enumerate(lengths)])
            elif action == "free" and seq_id in live:
                blocks.free(seq_id)
                live.remove(seq_id)
        except OutOfPages:
            pass
        held = [p for s in live for entry in blocks.entries[s].pages for p in entry]
        assert len(held) == len(set(held)) == num_pages - blocks.pool.num_free
        hosted = [p for s in live for p in blocks.host_pages(s)]
        assert len(hosted) == len(set(hosted)) == num_host - blocks.pools["host"].num_free
        for s in live:
            lists = blocks.entries[s]
            resident = [-(-n // page_size) if e not in offloaded else 0
                        for e, n in enumerate(lists.lengths)]  # fmt: skip
            assert [len(p) for p in lists.pages] == resident
            longest = max((lists.lengths[e] for e in offloaded), default=0)
            assert len(lists.host) == -(-longest // page_size)  # the longest offloaded entry
    for seq_id in list(live):
        blocks.free(seq_id)
    assert blocks.pool.num_free == num_pages and blocks.pools["host"].num_free == num_host


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=6), st.integers(1, 30))
def test_decode_tokens_between_pages_only_count_and_each_page_comes_on_time(kept, steps):
    """After compression a step visits only the entries due a page (the sequence's ``due``:
    its token count at which each entry's last page fills); every step's lengths, newest
    indices, pages, new pages and pages needed are those of visiting every entry."""
    size = 4
    blocks = EntryBlockManager(size, 200, len(kept))
    blocks.allocate_prompt(0, list(range(20)))
    blocks.compress(0, kept)
    lists, taken = blocks.entries[0], []
    for step in range(1, steps + 1):
        at_end = [n for n in lists.lengths if n % size == 0]  # entries whose pages are full
        assert blocks.pages_needed(0) == len(at_end)
        blocks.append_token(0)
        taken += lists.added
        lists.added = []
        assert lists.lengths == [n + step for n in kept]
        assert lists.newest == [n + step - 1 for n in kept]
        assert [len(p) for p in lists.pages] == [-(-(n + step) // size) for n in kept]
        due = {e: t for t, entries in lists.due.items() for e in entries}  # each entry once
        assert sorted(due) == list(range(len(kept)))
        assert [due[e] - 20 - step for e in range(len(kept))] == [
            -(-(n + step) // size) * size - n - step for n in kept
        ]  # steps to its page's end
    grown = [p for n, pages in zip(kept, lists.pages, strict=True) for p in pages[-(-n // size) :]]
    assert sorted(p for _, _, p in taken) == sorted(grown)  # each page a step took, once
    assert sorted(blocks.table(0).pages) == sorted(p for pages in lists.pages for p in pages)
    assert blocks.table(0).num_tokens == 20 + steps


@pytest.mark.parametrize("kind", ["offloaded", "ring"])
def test_offloaded_and_ring_entries_are_visited_every_step(kind):
    """An offloaded entry (its tokens in the shared host pages) or a ring (over its oldest
    window token once full) changes every step: such a sequence visits every entry."""
    blocks = EntryBlockManager(4, 40, 3)
    blocks.reset(PoolLayout(40, offloaded=(1,) if kind == "offloaded" else ()))
    blocks.grow_host(20)
    blocks.allocate_prompt(0, list(range(10)))
    blocks.compress(0, [5, 6, 6], rings={2: (2, 4)} if kind == "ring" else None)
    for _ in range(3):
        blocks.append_token(0)
        assert blocks.entries[0].due is None
    assert blocks.entries[0].lengths[:2] == [8, 9]
    if kind == "ring":  # full at 6 of 2 + 4: its newest token goes round the window
        assert blocks.entries[0].lengths[2] == 6 and blocks.entries[0].newest[2] == 4


def test_a_token_that_fills_no_page_takes_none_and_out_of_pages_changes_nothing():
    blocks = EntryBlockManager(4, 6, 2)
    blocks.allocate_prompt(0, list(range(8)))  # 2 entries x 2 pages
    assert blocks.pages_needed(0) == 2
    blocks.compress(0, [3, 8])  # entry 0 frees a page, entry 1 keeps both
    assert blocks.pool.num_free == 3 and blocks.pages_needed(0) == 1
    blocks.append_token(0)
    assert blocks.entries[0].lengths == [4, 9] and blocks.pool.num_free == 2
    assert blocks.future_pages(0, 9 + 4) == 1 + 1  # entry 0: 8 tokens, entry 1: 13
    blocks.allocate_prompt(1, list(range(4)))  # takes the last two pages
    before = [list(p) for p in blocks.entries[0].pages]
    with pytest.raises(OutOfPages):
        blocks.append_token(0)
    assert blocks.entries[0].pages == before and blocks.entries[0].lengths == [4, 9]


# -- decode over rows of per-head lengths ---------------------------------------------------


@pytest.mark.parametrize("num_kv_heads,group", [(1, 1), (2, 4), (4, 2)])
@pytest.mark.parametrize("reference", [False, True])
def test_entry_decode_equals_the_reference_over_each_rows_tokens(num_kv_heads, group, reference):
    torch.manual_seed(num_kv_heads * 10 + group)
    num_seqs, dim, page_size, num_pages = 3, 64, 8, 80
    k, v = torch.randn(2, num_pages * page_size, dim).unbind(0)
    num_rows = num_seqs * num_kv_heads
    lengths = torch.randint(1, 5 * page_size, (num_rows,), dtype=torch.int32)
    lengths[1] = 0  # a head that kept nothing
    pages = torch.randperm(num_pages)[: num_rows * 5].view(num_rows, 5).int()
    q = torch.randn(num_seqs, num_kv_heads * group, dim)
    new_kv = torch.randn(2, num_seqs, num_kv_heads, dim)
    grown = (lengths + 1).clamp(max=5 * page_size)
    unused = torch.arange(5) >= (grown[:, None] + page_size - 1) // page_size
    pages[unused] = 2**30  # no column past a row's pages is read: a page far outside there
    out, lse = entry_decode(q, k, v, pages, grown, page_size, new_kv=new_kv, reference=reference)
    for row in range(num_rows):
        seq, head = divmod(row, num_kv_heads)
        positions = torch.arange(int(grown[row]))
        slots = pages[row].long()[positions // page_size] * page_size + positions % page_size
        assert torch.equal(k[slots[-1]], new_kv[0, seq, head])  # the new token was stored
        heads = slice(head * group, (head + 1) * group)
        want, want_lse = reference_attention(q[seq, heads][:, None], k[slots][None],
                                             v[slots][None])  # fmt: skip
        torch.testing.assert_close(out[seq, heads], want[:, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[seq, heads], want_lse[:, 0], atol=1e-5, rtol=1e-5)


# -- compression ----------------------------------------------------------------------------


def _entry_slots(tier, seq_id: int, num_positions: int) -> torch.Tensor:
    """Plane slots ``[entries, positions]`` of every entry of ``seq_id``."""
    slots = tier._slots(seq_id, num_positions)
    return torch.stack([slots.entry(e) for e in range(len(tier.blocks.entries[seq_id].pages))])


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_compression_moves_exactly_the_policys_tokens_to_the_front(policy):
    torch.manual_seed(1)
    num_layers, num_kv_heads, group, dim, page_size, prompt = 2, 2, 2, 16, 4, 37
    blocks = EntryBlockManager(page_size, 200, num_layers * num_kv_heads)
    blocks.allocate_prompt(7, list(range(prompt)))
    plane = torch.randn(2, 200 * page_size, dim)
    head_scores = torch.rand(num_layers, num_kv_heads)
    budget = KVBudget(0.4, policy, window=8)
    # what compression reads of a site: its page lists, kernels, budget and head scores
    site = TierSite(store=None, host=None, blocks=blocks, spec=None, q_per_kv=group,
                    backend="reference", max_slots=2, per_entry_pages=True, budget=budget,
                    head_scores=head_scores)  # fmt: skip
    executor = BudgetTier(site, plane, EntryLayout([num_kv_heads] * num_layers))
    executor.window_q = {layer: torch.randn(budget.window, num_kv_heads * group, dim)
                         for layer in range(num_layers)}  # fmt: skip
    slots = _entry_slots(executor, 7, prompt)  # [entries, prompt]
    original = plane[:, slots].clone()  # [2, entries, prompt, dim]
    keys = original[0].view(num_layers, num_kv_heads, prompt, dim)
    scores = [observation_scores(executor.window_q[layer].transpose(0, 1), keys[layer])
              for layer in range(num_layers)]  # fmt: skip
    expected = [p for layer in kept_positions(budget, scores, prompt, head_scores) for p in layer]
    counts = executor.after_prefill(7, prompt)
    assert counts == [len(p) for p in expected]
    assert sum(counts) == pytest.approx(budget.tokens(prompt) * len(counts), abs=len(counts))
    assert len(set(counts)) == 1 or policy != "snapkv"
    for entry, positions in enumerate(expected):
        front = blocks.entries[7].pages[entry]
        assert len(front) == -(-len(positions) // page_size)
        held = _entry_slots(executor, 7, len(positions))[entry]
        torch.testing.assert_close(plane[:, held], original[:, entry, positions])
    assert blocks.pool.num_free == 200 - sum(-(-n // page_size) for n in counts)


# -- the engine -----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["snapkv", "ada_snapkv"])
def test_a_budget_covering_the_prompt_equals_the_exact_run(tiny_llama, policy):
    prompt = _prompts([150])[0]
    exact = make(tiny_llama)
    budgeted = make(tiny_llama, kv_budget=1.0, kv_policy=policy)
    want = exact.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    got = budgeted.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    assert got.token_ids == want.token_ids
    gap = decode_logits(budgeted, prompt, 20) - decode_logits(exact, prompt, 20)
    assert gap.abs().max().item() < 1e-4


def test_a_small_budget_holds_fewer_pages_and_batches_equal_one_at_a_time(tiny_llama):
    prompts = _prompts([200, 90, 160], seed=3)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    llm = make(tiny_llama, kv_budget=0.25)
    alone = [llm.generate(p, params)[0] for p in prompts]
    kept = {e.budget for e in plan_of(llm).head_map.entries}
    assert kept == {KVBudget(0.25).tokens(len(prompts[-1]))}  # the last request's, not the first
    together = llm.generate(prompts, params)
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    exact = make(tiny_llama)
    assert any(
        o.token_ids != exact.generate(p, params)[0].token_ids
        for o, p in zip(alone, prompts, strict=True)
    )  # it is an approximation
    stats = alone[0].stats
    assert stats.kv_held_fraction is not None
    assert 0.25 <= stats.kv_held_fraction < 0.45  # kept quarter + decoded tokens + rounding
    assert "KV held" in stats.summary()


def test_one_kv_head_a_layer_batches_equal_one_at_a_time(tmp_path, embedded_dir):
    """A model with one kv head a layer (multi-query): each layer's rows of a batch are
    strided in the per-slot tables, and still read right."""
    from conftest import make_tiny_checkpoint

    make_tiny_checkpoint("llama3", tmp_path, embedded_dir, num_key_value_heads=1)
    prompts = _prompts([120, 70], seed=4)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    llm = make(tmp_path, kv_budget=0.5)
    alone = [llm.generate(p, params)[0].token_ids for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, params)] == alone


def test_budget_options_fail_in_one_line(tiny_llama):
    for options, message in [({"kv_budget": 0.0}, "kv_budget"), ({"kv_budget": 1.5}, r"\(0, 1\]"),
                             ({"kv_budget": 0.5, "offload": "layer"}, "offload"),
                             ({"kv_budget": 0.5, "kv_policy": "headkv"}, "profile"),
                             ({"kv_budget": 0.5, "kv_policy": "h2o"}, "kv_policy"),
                             ({"kv_budget": 0.5, "kv_pool": 8}, "kv_pool")]:  # fmt: skip
        with pytest.raises(UserError, match=message):
            make(tiny_llama, **options)


def test_eval_compare_modes_name_a_policy_and_its_budget():
    from headspace.cli.eval import _mode_options

    base = {"offload": "auto", "cpu_sparsity": None, "kv_budget": None}
    mode = _mode_options("ada_snapkv:0.25", base)
    assert (mode["kv_policy"], mode["kv_budget"], mode["offload"]) == ("ada_snapkv", 0.25, "none")
    assert _mode_options("snapkv:2048tok", base)["kv_budget"] == 2048  # as --kv-budget reads it
    assert _mode_options("none", {**base, "kv_budget": 0.5})["kv_budget"] is None  # exact
    for bad in ("snapkv:x", "none:1", "snapkv:2048"):  # a bare number above 1: ambiguous
        with pytest.raises(UserError):
            _mode_options(bad, base)


# -- offloaded entries (HeadInfer App. D) ---------------------------------------------------


def _entry_arena(checkpoint, spec: KVSpec, pages: int, max_context: int = 512) -> int:
    """The KV arena whose entry plane holds ``pages`` entry pages (beside the keys a
    layer's prefill gathers)."""
    from headspace.planner.sparsity import gathered_bytes

    config = load_config(checkpoint)
    gathered = gathered_bytes(spec.num_kv_heads, config.num_queries_per_kv, spec.head_dim, 4,
                              max_context)  # fmt: skip
    return pages * spec.entry_page_bytes + gathered


@pytest.mark.parametrize("policy,min_run", [("snapkv", None), ("ada_snapkv", None),
                                             ("snapkv", 1), ("snapkv", 2)])  # fmt: skip
def test_offloaded_entries_equal_the_all_resident_budget(tiny_llama, policy, min_run,
                                                         monkeypatch):  # fmt: skip
    """Entries in host pages keep, stream and extend exactly what resident ones would; their
    pages staged by the page kernel, by the copy engine over runs of adjacent host pages
    (``min_run``: the shortest such run), or both."""
    from headspace.tiers.entry_staging import EntryStaging

    if min_run is not None:
        monkeypatch.setattr(EntryStaging, "MIN_RUN_PAGES", min_run)
    spec = KVSpec.of(load_config(tiny_llama), PAGE, 4)
    prompts = _prompts([200, 150, 60], seed=7)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    resident = make(tiny_llama, kv_budget=0.25, kv_policy=policy)
    want = [resident.generate(p, params)[0].token_ids for p in prompts]
    plans, streamed = [], []

    def seen(name: str) -> None:  # the layout in force as each step starts
        plans.append(llm.engine.load().lane(name).plan)

    llm = make(tiny_llama, _entry_arena(tiny_llama, spec, 80), kv_budget=0.25, kv_policy=policy,
               hooks=EngineHooks(lane_step=seen))  # fmt: skip
    runner = llm.engine.lanes.resident.runner  # (per-entry pages: one lane)

    def recording(seq_ids, step):
        result = step()
        staging = runner.tiers[0].staging
        if staging is not None:
            streamed.append(staging.streamed_bytes)
            batched.append(len(seq_ids))
            by_run.append(sum(run[-1] for runs in staging.runs for run in runs))
            by_kernel.append(sum(pairs.shape[1] for pairs in staging.pairs))
        return result

    batched, by_run, by_kernel = [], [], []

    runner.decode_hooks.append(recording)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    offloaded = [p.head_map.count("stream") for p in plans if p is not None]
    assert max(offloaded) > 0
    assert all(p.entry_staging > 0 for p in plans if p and p.head_map.count("stream"))
    kept_bytes = 50 * spec.entry_token_bytes  # an entry's 0.25 of 200 tokens
    assert kept_bytes <= max(streamed) < spec.num_entries * 230 * spec.entry_token_bytes
    if policy == "snapkv":  # an even budget's staging is small: sequences share the steps
        assert max(batched) >= 2
    # pages staged by each path: the kernel alone by default (runs of a few pages), the copy
    # engine alone from runs of one page, both where the rows' runs are of one and more pages
    assert (sum(by_run) > 0, sum(by_kernel) > 0) == {None: (False, True), 1: (True, False),
                                                     2: (True, True)}[min_run]  # fmt: skip
    counters = runner.site.counters  # the same totals, kept by the tiers themselves
    assert (counters.run_pages, counters.kernel_pages) == (sum(by_run), sum(by_kernel))
    gap = decode_logits(llm, prompts[0], 12) - decode_logits(resident, prompts[0], 12)
    assert gap.abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "page,lo,hi,width", [(16, 0, 100, 128), (48, 0, 40, 128), (16, 37, 90, None)]
)
def test_keys_gathered_from_both_tiers_are_each_positions_keys(page, lo, hi, width):
    """Resident heads from the plane, offloaded ones from shuffled host pages (the host
    page's rows hold only the offloaded heads); columns past ``hi - 1`` repeat it (a padded
    capacity), whatever the page size."""
    from types import SimpleNamespace

    from headspace.tiers.entry_staging import EntryStaging

    generator = torch.Generator().manual_seed(page + lo)
    heads, dim, num_pages = 3, 8, 8
    host_pages = torch.randperm(num_pages, generator=generator)[: -(-hi // page)].tolist()
    host = torch.randn(1, 2, num_pages * page, dim, generator=generator)  # one layer, one row
    plane = torch.randn(2, heads * num_pages * page, dim, generator=generator)
    plane_slots = torch.randperm(plane.shape[1], generator=generator)[: heads * hi].view(heads, hi)
    arena = SimpleNamespace(layer=lambda layer: host)
    staging = EntryStaging(plane, arena, [[1]], [heads], page, 0, 0)
    keys = staging.gather(0, plane_slots, lo, hi, host_pages, width)
    columns = torch.arange(lo, lo + (width or hi - lo)).clamp(max=hi - 1)
    host_slots = torch.tensor(host_pages)[columns // page] * page + columns % page
    for h in range(heads):
        want = host[0][:, host_slots] if h == 1 else plane[:, plane_slots[h, columns]]
        assert torch.equal(keys[:, h], want)


def test_decode_graphs_follow_the_tiers_when_a_layout_comes_back(tiny_llama):
    """A short request (every entry resident: decode graphs), long ones (entries in host
    pages: another layout, new tiers), then the short one again: its graphs are captured
    anew over the tiers built for it, and its tokens are a fresh engine's."""
    from graph_twin import EagerGraphTwin
    from headspace.engine.hooks import EngineHooks

    spec = KVSpec.of(load_config(tiny_llama), PAGE, 4)
    short, *long = _prompts([40, 150, 180, 220], seed=9)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    options = {"kv_budget": 0.25, "hooks": EngineHooks(graphs=EagerGraphTwin)}
    arena = _entry_arena(tiny_llama, spec, 80)
    fresh = make(tiny_llama, arena, **options).generate(short, params)[0].token_ids
    llm = make(tiny_llama, arena, **options)
    runner = llm.engine.lanes.resident.runner  # (per-entry pages: one lane)
    assert llm.generate(short, params)[0].token_ids == fresh
    first = runner.graphs
    for prompt in long:
        llm.generate(prompt, params)
    assert runner.plan.entry_staging  # the long ones' layout put entries in host pages
    assert llm.generate(short, params)[0].token_ids == fresh
    assert runner.graphs is not first and runner.graphs.tiers == runner.tiers

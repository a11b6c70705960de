"""The hybrid tier's sparse mode (HGCA's beta): the selection rule, the moving averages and
their eviction, re-evaluation, and end to end against the exact run."""

from __future__ import annotations

import pytest
import torch

from conftest import plan_of
from headspace import SamplingParams, UserError
from headspace.attention.paged import paged_token_probs
from headspace.attention.reference import reference_attention
from headspace.engine.hooks import EngineHooks
from headspace.tiers.cpu_timings import CpuTimings
from headspace.tiers.hybrid_sparse import SparseSelector, SparseState, renormalise, salient
from test_hybrid import decode_logits
from test_offload import GREEDY, _prompts, make

SPARSE = {"offload": "hybrid", "gpu_window": 16}


def test_selection_keeps_exactly_the_entries_above_beta_over_n():
    weights = torch.tensor([[0.05, 0.25, 0.2, 0.5], [0.7, 0.1, 0.1, 0.1]])
    # beta 1 over 4 entries: above 0.25 (strictly, as HGCA writes it)
    assert salient(weights, 1.0, 4).tolist() == [[False, False, False, True], [True] + [False] * 3]
    assert salient(weights, 0.5, 4).tolist() == [[False, True, True, True], [True] + [False] * 3]
    assert salient(weights, 0.0, 4).all()  # beta 0 keeps every entry with any weight


def test_kept_positions_join_the_reevaluation_and_later_evictions():
    state = SparseState([0, 1], cpu_end=8)
    assert not state.ready
    state.reevaluate(0, range(2), torch.tensor([[0.5, 0, 0, 0, 0, 0, 0, 0.5]] * 2), 1.0)
    state.reevaluate(1, range(2), torch.full((2, 8), 1 / 8), 0.5)
    assert not state.ready  # pending until applied
    state.apply()
    assert state.ready
    maw = torch.zeros(2, 2, 4)
    maw[0, 1, 2] = 0.3  # layer 0, head 1, token 8 + 2: above 1 / 4
    state.evict(8, maw, beta=1.0, num_gpu_tokens=4)
    assert state.kept(0, 0).tolist() == [0, 7]
    assert state.kept(0, 1).tolist() == [0, 7, 10]
    assert state.kept(1, 0).tolist() == list(range(8))
    assert state.evicted_end == 12
    assert state.fractions({0: range(2)}) == [2 / 12, 3 / 12]


def test_reevaluation_reinstates_a_token_whose_weight_rises():
    state = SparseState([0], cpu_end=0)
    low = torch.full((1, 1, 4), 0.01)
    state.evict(0, low, beta=1.0, num_gpu_tokens=4)  # all four below 1 / 4: dropped
    assert state.kept(0, 0).tolist() == []
    risen = torch.tensor([[0.05, 0.05, 0.85, 0.05]])  # token 2 is now salient
    state.reevaluate(0, range(1), risen, 1.0)
    state.apply()
    assert state.kept(0, 0).tolist() == [2]


def test_kept_weights_are_renormalised_to_sum_to_one():
    """HGCA's 3.2.2 by hand: weights 0.5, 0.25, 0.125, 0.125 (multiples of 1/4: 2, 1, 0.5,
    0.5); beta 1 keeps the first alone, whose weight becomes 1 (multiple 4); the dropped
    keep theirs. A head that keeps nothing is left as it was, and so are kept weights that
    already sum to 1 or more (maxima over queries can): never lowered."""
    maw = torch.tensor([[2.0, 1.0, 0.5, 0.5], [1.0, 1.0, 1.0, 1.0]])
    keep = salient(maw, 1.0, 1)
    assert keep.tolist() == [[True, False, False, False], [False] * 4]
    assert renormalise(maw, keep).tolist() == [[4.0, 1.0, 0.5, 0.5], [1.0, 1.0, 1.0, 1.0]]
    keep = salient(maw, 0.4, 1)  # 2 + 1 + 0.5 + 0.5 = 4: already summing to 1
    assert renormalise(maw, keep).tolist() == maw.tolist()
    maxima = torch.tensor([[1.2, 1.2, 1.2, 1.2]])  # weights 0.3 each: 1.2 in all
    assert renormalise(maxima, salient(maxima, 1.0, 1)).tolist() == maxima.tolist()


def test_a_token_any_reevaluation_found_salient_stays_kept():
    """The running maximum: a later query that gives a token nothing does not drop it, and a
    token it finds is added (one query's weights are not the next ones'); also where the
    weights are maxima over queries, summing past 1."""
    state = SparseState([0], cpu_end=4)
    state.reevaluate(0, range(1), torch.tensor([[0.7, 0.1, 0.1, 0.1]]), 1.0)
    state.apply()
    assert state.kept(0, 0).tolist() == [0]
    state.reevaluate(0, range(1), torch.tensor([[0.0, 0.1, 0.8, 0.05, 0.05]]), 1.0)
    state.apply()
    assert state.kept(0, 0).tolist() == [0, 2]
    state = SparseState([0], cpu_end=4)
    state.reevaluate(0, range(1), torch.tensor([[0.3, 0.3, 0.3, 0.3]]), 1.0)
    state.reevaluate(0, range(1), torch.tensor([[0.1, 0.1, 0.1, 0.1, 0.6]]), 1.0)
    state.apply()
    assert state.kept(0, 0).tolist() == [0, 1, 2, 3, 4]


def test_a_first_selection_takes_the_most_any_prompt_query_gives():
    """The prompt's last queries, observed chunk by chunk (the last ``OBSERVED_QUERIES``
    kept, with their positions), weigh the first selection beside the step's own query:
    per kv head the largest weight over its query heads and the queries. Only queries that
    see every CPU-side token are taken."""
    from headspace.tiers.hybrid_sparse import OBSERVED_QUERIES

    selector = _selector()
    q = torch.arange(40 * 4 * 3, dtype=torch.float32).view(40, 4, 3)  # positions 0 .. 39
    selector.observe(7, 0, q[:30], 30)
    selector.observe(7, 0, q[30:], 40)  # a second chunk: the last 32 of both
    selector.observe(7, 1, q, 40)
    selector.begin([7], [41], [12])
    assert selector.prompt_queries(0, 0, 9).tolist() == q[-OBSERVED_QUERIES:].tolist()
    assert selector.prompt_queries(0, 0, 9) is None  # once
    assert selector.prompt_queries(0, 1, 20).tolist() == q[19:].tolist()  # positions >= 19
    step = torch.full((4, 12), 1 / 12)  # the step's query: nothing above uniform
    prompt = torch.zeros(3, 4, 12)
    prompt[:, :, 0] = 1.0  # every prompt query: token 0 ...
    prompt[2, 2, 0], prompt[2, 2, 9] = 0.5, 0.5  # ... but one, of kv head 1, also token 9
    selector.reevaluate(0, 0, (0, 2), step, 12, prompt)
    selector.reevaluate(0, 1, (0, 2), step, 12)
    selector.drain()
    selector.states[7].apply()
    assert selector.states[7].kept(0, 0).tolist() == [0]
    assert selector.states[7].kept(0, 1).tolist() == [0, 9]
    assert selector.states[7].kept(1, 0).tolist() == []  # no prompt queries: the step's


def test_the_prompt_queries_of_every_hybrid_layer_reach_the_first_selection(wide_llama, prompt):
    """Through the engine: once the prompt is prefilled, the selector holds its last 32
    queries for every layer with hybrid heads; the first decode step takes them all."""
    held, tiers = {}, []

    def look(name: str) -> None:  # on the offload lane's thread, before each of its steps
        runner = llm.engine.lanes.lane(name).runner
        tier = next((t for t in runner.tiers if getattr(t, "sparse", None)), None)
        if tier is not None and any(tier.sparse.observed.values()):  # the last step with them
            held.clear()
            held.update({seq: dict(layers) for seq, layers in tier.sparse.observed.items()})
            tiers[:] = [tier]

    llm = make(wide_llama, arena=700 * 1024, cpu_sparsity=1.0, hooks=EngineHooks(lane_step=look),
               **SPARSE)  # fmt: skip
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    runner = engine.lanes.lane("offload").runner  # (the prompt fits only with heads offloaded)
    tier = tiers[0]
    head_map = runner.plan.head_map
    layers = [layer for layer in range(head_map.num_layers) if head_map.offloaded_groups(layer)]
    assert len(held) == 1 and sorted(next(iter(held.values()))) == layers
    for tail, _, end in next(iter(held.values())).values():
        assert tail.shape[0] == 32 and end == len(prompt)
    assert tier.sparse.observed == {}  # read by the first selection, or forgotten at the end


def test_prompt_queries_weigh_the_cpu_side_tokens_as_softmax_does():
    """The weights of the prompt's queries over a sequence's CPU-side tokens (a few queries
    a kernel call, as query heads of their kv head) equal each query's softmax."""
    from headspace.kv.host_store import HostKVArena
    from headspace.kv.spec import KVSpec
    from headspace.tiers.cpu_attention import CpuAttention

    torch.manual_seed(0)
    arena = HostKVArena(KVSpec(1, 2, 16, 4, 4), torch.float32, pin=False, budget=None)
    arena.ensure(8)
    arena.layer(0).normal_()
    attention = CpuAttention(arena, num_threads=1)
    pages = [5, 2, 7]
    attention.begin([pages], [11])
    queries = torch.randn(40, 6, 16)  # 40 queries, 3 query heads per kv head: 2 calls
    probs = attention._query_probs(queries, 0, (0, 2), 0)
    slots = torch.cat([torch.arange(p * 4, p * 4 + 4) for p in pages])[:11]
    keys = arena.layer(0)[:, 0, slots].float()  # [kv heads, tokens, dim]
    scores = torch.einsum("qhd,htd->qht", queries, keys.repeat_interleave(3, 0)) / 4.0
    assert torch.allclose(probs, torch.softmax(scores, -1), atol=1e-5)


def test_each_append_is_reevaluated_and_taken_over_a_fixed_number_of_steps_later():
    """A page leaving the window makes the next step dense and weighed; the selection it
    starts replaces the old one exactly ``SELECTION_DELAY`` steps later."""
    from headspace.tiers.hybrid_sparse import SELECTION_DELAY

    selector = _selector()
    selector.begin([7], [20], [12])
    assert selector.weigh == [0] and selector.dense == [0]  # the first CPU-side step
    for layer in (0, 1):
        selector.reevaluate(0, layer, (0, 2), torch.full((4, 12), 1 / 12), 12)
    for step in range(1, SELECTION_DELAY):
        selector.begin([7], [20 + step], [12])
        assert selector.dense == [0] and selector.weigh == []  # waits for its selection
    selector.begin([7], [20 + SELECTION_DELAY], [12])
    assert selector.sparse == [0] and selector.weigh == []
    state = selector.states[7]
    assert state.kept(0, 0).tolist() == []  # 1/12 is not above 1/12
    selector.begin([7], [28], [16])  # a page leaves the window: weighed again, densely
    assert selector.weigh == [0] and selector.dense == [0]
    weights = torch.zeros(4, 16)
    weights[:, 5] = 1.0
    for layer in (0, 1):
        selector.reevaluate(0, layer, (0, 2), weights, 16)
    for step in range(1, SELECTION_DELAY):
        selector.begin([7], [28 + step], [16])
        assert selector.sparse == [0] and state.kept(0, 0).tolist() == []  # the old one
    selector.begin([7], [28 + SELECTION_DELAY], [16])
    assert selector.sparse == [0] and state.kept(0, 0).tolist() == [5]


def _selector(kv_heads: dict[int, range] | None = None, num_layers: int = 2,
              num_kv_heads: int = 2, window: int = 8, page_size: int = 4,
              query_blocks: int = 0) -> SparseSelector:  # fmt: skip
    """A selector of beta 1 and alpha 0.5 over 4 rows (every kv head of every layer
    offloaded unless ``kv_heads`` says which)."""
    from headspace.kv.spec import KVSpec
    from headspace.tiers.settings import HybridSettings

    settings = HybridSettings(sparsity=1.0, maw_alpha=0.5, gpu_window=window,
                              query_blocks=query_blocks)  # fmt: skip
    spec = KVSpec(num_layers, num_kv_heads, 4, page_size, 4)  # (its head_dim: not read)
    if kv_heads is None:
        kv_heads = {layer: range(num_kv_heads) for layer in range(num_layers)}
    return SparseSelector(settings, spec, kv_heads, 4, torch.device("cpu"))


def test_moving_average_starts_at_the_first_weight_and_moves_by_alpha():
    selector = _selector()
    selector.begin([7], [20], [12])  # tokens 12..20 on the GPU side
    probs = torch.zeros(1, 4, 9)  # 2 kv heads x 2 query heads
    probs[0, 0, 3], probs[0, 1, 3] = 0.2, 0.6  # kv head 0 takes the larger of its queries
    offsets, lengths = torch.tensor([12]), torch.tensor([9])
    selector.track(0, (0, 2), probs, offsets, lengths)
    ring = selector.ring
    assert selector.maw[0, 0, 0, 15 % ring].item() == pytest.approx(0.6)
    assert selector.maw[0, 0, 1, 15 % ring].item() == 0.0
    probs[0, 1, 3] = 0.2
    selector.track(0, (0, 2), probs, offsets, lengths)
    assert selector.maw[0, 0, 0, 15 % ring].item() == pytest.approx(0.4)  # 0.5 0.6 + 0.5 0.2
    assert selector.maw[0, 1, 0, 15 % ring].item() == -1.0  # layer 1 not tracked yet


def test_pages_leaving_the_window_are_selected_by_their_moving_average():
    selector = _selector()
    selector.begin([7], [20], [12])
    probs = torch.zeros(1, 4, 9)
    probs[0, 2, 1] = 0.5  # kv head 1 attends token 13
    selector.track(0, (0, 2), probs, torch.tensor([12]), torch.tensor([9]))
    selector.track(1, (0, 2), probs, torch.tensor([12]), torch.tensor([9]))
    selector.begin([7], [24], [16])  # tokens 12..15 leave; 13 GPU-side tokens then
    state = selector.states[7]
    assert state.evicted_end == 16
    assert state.kept(0, 1).tolist() == [13] and state.kept(0, 0).tolist() == []
    assert (selector.maw[0, :, :, torch.arange(12, 16) % selector.ring] == -1).all()
    selector.begin([8], [3], [0])  # 7 left the batch: its summary stays, its row is free
    assert 7 not in selector.states and selector.summary(7) is not None
    assert selector.rows[8] == 0


def test_token_probs_are_the_softmax_weights():
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 16), torch.randn(2, 64, 16)
    tables = torch.tensor([[3, 1, 0, 0], [2, 0, 0, 0]], dtype=torch.int32)
    lengths = torch.tensor([37, 9])
    lse = torch.empty(2, 4)
    for row in range(2):
        slots = torch.cat([torch.arange(p * 16, p * 16 + 16) for p in tables[row].tolist()])
        keys = k[:, slots[: lengths[row]]]
        lse[row] = reference_attention(q[row][:, None], keys, keys)[1][:, 0]
    probs = paged_token_probs(q, k, tables, lengths, 40, 16, lse)
    assert probs.shape == (2, 4, 40)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 4), atol=1e-5)
    assert (probs[1, :, 9:] == 0).all()


def _pairs(timings: CpuTimings, sparse: bool) -> int:
    """(token, kv head) pairs the CPU kernel attended in ``timings``' calls: the sparse rows'
    (token tables, page size 1: one row per sequence and kv head), or the dense ones'."""
    return sum(call.tokens * call.kv_heads for call in timings.calls
               if (call.page_size == 1) == sparse)  # fmt: skip


def test_beta_zero_keeps_everything_and_equals_exact(wide_llama, prompt, cpu_timings):
    resident = make(wide_llama)
    expected = resident.generate(prompt, GREEDY)[0].token_ids
    llm = make(wide_llama, arena=700 * 1024, cpu_sparsity=0.0,
               hooks=EngineHooks(cpu_timings=cpu_timings), **SPARSE)  # fmt: skip
    out = llm.generate(prompt, GREEDY)[0]
    assert out.token_ids == expected
    assert out.stats.cpu_kept_fraction == (1.0, 1.0, 1.0)
    assert "CPU kept 100.0% median" in out.stats.summary()
    assert _pairs(cpu_timings, sparse=True) > 0  # after the first steps, the kept tokens
    gap = decode_logits(llm, prompt, 48) - decode_logits(resident, prompt, 48)
    assert gap.abs().max().item() < 1e-4


def test_query_blocks_covering_the_history_equal_exact(wide_llama, prompt):
    """Beta 3 keeps few tokens, but 64 query blocks cover this history whole: every
    CPU-side token is attended once (kept or in a block), so decode equals the exact run."""
    resident = make(wide_llama)
    llm = make(wide_llama, arena=700 * 1024, cpu_sparsity=3.0, cpu_query_blocks=64, **SPARSE)
    assert llm.generate(prompt, GREEDY)[0].stats.cpu_kept_fraction[1] < 0.9
    gap = decode_logits(llm, prompt, 48) - decode_logits(resident, prompt, 48)
    assert gap.abs().max().item() < 1e-4


def test_a_larger_beta_attends_fewer_tokens(wide_llama, prompt, cpu_timings):
    """Beta 3: only tokens some query weighs at three times the uniform weight (a random
    model attends nearly uniformly, so most tokens pass beta 1 for one of 32 queries). No
    query-aware blocks: 16 of them would cover this short history."""
    llm = make(wide_llama, arena=700 * 1024, cpu_sparsity=3.0, cpu_query_blocks=0,
               hooks=EngineHooks(cpu_timings=cpu_timings), **SPARSE)  # fmt: skip
    out = llm.generate(prompt, GREEDY)[0]
    low, median, high = out.stats.cpu_kept_fraction
    assert 0 <= low <= median <= high and median < 0.9 and high > 0
    exact = CpuTimings()
    dense = make(wide_llama, arena=700 * 1024, hooks=EngineHooks(cpu_timings=exact), **SPARSE,
                 cpu_share=1.0)  # fmt: skip
    dense.generate(prompt, GREEDY)
    sparse_pairs = _pairs(cpu_timings, sparse=False) + _pairs(cpu_timings, sparse=True)
    assert 0 < sparse_pairs < 0.9 * _pairs(exact, sparse=False)


def _timed_run(checkpoint, prompt, timings, **options):
    """Greedy tokens of ``prompt`` with the hybrid tier recording into ``timings``: its
    decode steps and the number of layers with hybrid heads."""
    llm = make(checkpoint, arena=700 * 1024, hooks=EngineHooks(cpu_timings=timings),
               **SPARSE, **options)  # fmt: skip
    out = llm.generate(prompt, GREEDY)[0]
    head_map = plan_of(llm).head_map
    layers = [layer for layer in range(head_map.num_layers) if head_map.offloaded_groups(layer)]
    return len(out.token_ids) - 1, len(layers)


def test_cpu_timings_record_every_kernel_call_and_wait(wide_llama, prompt):
    """``EngineHooks.cpu_timings``: one entry per CPU job (each layer with hybrid heads, each
    decode step), its K/V bytes; beta 0 keeps every token, so the sparse rows' calls read
    the exact mode's bytes, call for call. Without ``track_weights`` nothing is tracked."""
    exact = CpuTimings()
    steps, layers = _timed_run(wide_llama, prompt, exact, cpu_share=1.0)
    assert steps > 0 and layers > 0
    exact_bytes = exact.jobs + [nbytes for _, nbytes in exact.kernel]  # native jobs, or not
    assert len(exact_bytes) == len(exact.result) == steps * layers
    assert min(exact_bytes) > 0 and exact.track == exact.begin == exact.tables == []
    sparse = CpuTimings()
    sparse_steps, _ = _timed_run(wide_llama, prompt, sparse, cpu_sparsity=0.0)
    assert sparse_steps == steps and sparse.jobs == []  # the Python worker's calls
    assert [nbytes for _, nbytes in sparse.kernel] == exact_bytes
    assert all(seconds > 0 for seconds, _ in sparse.kernel)
    assert len(sparse.query) == len(sparse.result) == steps * layers
    assert len(sparse.begin) == steps and len(sparse.track) >= steps * layers
    assert 0 < len(sparse.tables) < steps * layers  # the first steps are dense
    untracked = CpuTimings(track_weights=False)
    sparse.clear()
    assert sparse.kernel == sparse.result == sparse.track == []
    _timed_run(wide_llama, prompt, untracked, cpu_sparsity=0.0)
    assert untracked.track == [] and len(untracked.kernel) == steps * layers
    assert len(untracked.begin) == steps and len(untracked.tables) > 0


def test_sparse_batch_equals_one_at_a_time(tiny_llama):
    prompts = _prompts([180, 12, 90, 7])
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    # every entry hybrid; one query block a step (16 would cover these short histories)
    options = {"arena": 10 * 1024, "cpu_sparsity": 2.0, "cpu_query_blocks": 1, **SPARSE}
    expected = [make(tiny_llama, **options).generate(p, params)[0] for p in prompts]
    outs = make(tiny_llama, **options).generate(prompts, params)
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    kept = [o.stats.cpu_kept_fraction for o in outs]
    assert kept == [e.stats.cpu_kept_fraction for e in expected]
    assert all(median < 0.6 for _, median, _ in kept)  # each selects by its own weights


@pytest.mark.parametrize(
    "options",
    [{"cpu_sparsity": -1.0}, {"cpu_sparsity": "1"}, {"cpu_sparsity": 1.0, "offload": "head"},
     {"cpu_sparsity": 1.0, "cpu_share": 0.5}, {"maw_alpha": 0.0}, {"maw_alpha": 1.5},
     {"cpu_query_blocks": -1}, {"cpu_query_blocks": 1.5}],
)  # fmt: skip
def test_bad_sparse_options_are_refused(tiny_llama, options):
    with pytest.raises(UserError):
        make(tiny_llama, **{"offload": "hybrid", **options})

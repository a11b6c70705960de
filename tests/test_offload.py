"""Tiers that follow the running batch: every plan equals the all-resident run exactly.

Budgets are given in bytes so that the KV arena (what the budget leaves after weights,
a chunk's activations with allocator slack and batched decode) is an exact size.
"""

from __future__ import annotations

import pytest
import torch

from conftest import plan_of, pools_back, ran_in
from headspace import LLM, SamplingParams, UserError
from headspace.engine.hooks import EngineHooks
from headspace.engine.step_plan import Sequence
from headspace.kv.host_store import HostKVArena
from headspace.kv.spec import KVSpec
from headspace.model.config import load_config
from headspace.planner.memory import decode_bytes, weight_bytes, working_bytes
from headspace.tiers.streamed import StreamedTier

CHUNK, PAGE = 64, 16


@pytest.fixture(scope="module")
def spec(tiny_llama) -> KVSpec:
    return KVSpec.of(load_config(tiny_llama), PAGE, 4)  # fp32: an entry's page is 2 KiB


def budget_for(checkpoint, arena: int) -> int:
    """The GPU budget whose KV arena is ``arena`` bytes."""
    config = load_config(checkpoint)
    return (weight_bytes(config, 4) + working_bytes(config, CHUNK, 4)
            + decode_bytes(config, 64, 4) + arena)  # fmt: skip


def make(checkpoint, arena: int | None = None, **options) -> LLM:
    budget = budget_for(checkpoint, arena) if arena is not None else None
    return LLM(str(checkpoint), prefill_chunk=CHUNK, page_size=PAGE, gpu_memory=budget, **options)


GREEDY = SamplingParams(max_new_tokens=64, ignore_eos=True)


def test_short_prompt_under_a_small_budget_runs_all_resident(tiny_llama, spec, prompt):
    """The budget cannot hold the model's 512-token context, but the request fits."""
    llm = make(tiny_llama, arena=12 * spec.full_page_bytes)
    whole = llm.engine.lanes.whole  # the planner of the whole arena
    assert whole.plan([Sequence(0, [1], 512)]).staging is not None  # max context streams
    out = llm.generate(prompt[:40], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    assert plan_of(llm).head_map.count("stream") == 0 and out.stats.lane == "resident"
    assert (out.stats.num_gpu_heads, out.stats.num_streamed_heads) == (6, 0)
    assert "heads 6 resident / 0 streamed" in out.stats.summary()


@pytest.mark.parametrize(
    "arena_kib,options,resident,depth,pieces",
    [
        (700, {"head_group": 1}, 20, 3, False),  # groups of one head, two slots ahead
        (700, {}, 15, 2, False),  # the planner's groups: a layer's four heads
        (700, {"offload": "layer"}, 12, 2, False),  # whole layers: three layers resident
        (100, {}, 1, 2, True),  # history attended in pieces of one slot
        (10, {}, 0, 2, True),  # every entry streams, one page per piece
    ],
)
def test_streamed_heads_equal_all_resident(wide_llama, prompt, arena_kib, options, resident,
                                           depth, pieces):  # fmt: skip
    reference = make(wide_llama)
    logits, tokens = reference.logits(prompt), reference.generate(prompt, GREEDY)[0].token_ids
    llm = make(wide_llama, arena=arena_kib * 1024, **options)
    assert (llm.logits(prompt) - logits).abs().max().item() <= 1e-5
    out = llm.generate(prompt, GREEDY)[0]
    assert out.token_ids == tokens
    plan = plan_of(llm)
    assert plan.head_map.count("gpu") == resident == out.stats.num_gpu_heads
    assert out.stats.num_streamed_heads == 32 - resident
    assert plan.staging.depth == depth
    pages = llm.engine.lanes.spec.pages_for(len(prompt) + GREEDY.max_new_tokens)
    assert (plan.staging.piece_pages < pages) == pieces
    stream = next(e for e in ran_in(llm).runner.tiers if isinstance(e, StreamedTier))
    # what a graph's step is weighed by: the map's streamed entries and groups
    assert (stream.num_heads, stream.num_groups) == (
        32 - resident,
        plan.head_map.num_offloaded_groups,
    )


def test_budget_sweep_from_the_smallest_that_runs_to_all_fits(tiny_llama, spec, prompt):
    """Every budget from "weights + working memory + one page of staging" up runs with the
    same greedy tokens; one byte less is refused with the numbers."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    smallest = 4 * spec.entry_page_bytes  # two staging slots of one page (+ scratch) of one head
    all_fits = (spec.pages_for(len(prompt) + 24) + 1) * spec.full_page_bytes
    expected = make(tiny_llama).generate(prompt, params)[0].token_ids
    for arena in torch.linspace(smallest, all_fits, 7).long().tolist():
        out = make(tiny_llama, arena=arena).generate(prompt, params)[0]
        assert out.token_ids == expected, f"arena {arena}"
    assert out.stats.num_streamed_heads == 0  # the last one is all resident
    with pytest.raises(UserError, match="GPU budget too small: streaming needs"):
        make(tiny_llama, arena=smallest - 1).generate(prompt, params)
    with pytest.raises(UserError, match=r"GPU budget too small: .* holds the weights"):
        make(tiny_llama, arena=-1).generate(prompt, params)


def _prompts(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40000, (n,), generator=generator).tolist() for n in lengths]


def test_batch_with_streamed_heads_equals_one_at_a_time(tiny_llama, spec):
    """The arena holds 4 pages of 16 tokens: the requests that fit it alone (12 and 7
    tokens, with their 40 new ones) run all resident in the resident lane, the others
    stream heads in the offload lane beside them; every output equals its run alone."""
    prompts = _prompts([180, 12, 30, 7, 25])
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    resident = make(tiny_llama)
    expected = [resident.generate(p, params)[0].token_ids for p in prompts]
    llm = make(tiny_llama, arena=60 * 1024)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    lanes = ["offload", "resident", "offload", "resident", "offload"]
    assert [o.stats.lane for o in outs] == lanes
    assert all((o.stats.num_streamed_heads > 0) == (lane == "offload")
               for o, lane in zip(outs, lanes, strict=True))  # fmt: skip
    assert pools_back(llm.engine)


def test_prefix_sharing_with_streamed_heads(tiny_llama):
    document = _prompts([160], seed=3)[0]
    prompts = [document + [11, 12], document + [21], document + [31, 32, 33]]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    resident = make(tiny_llama)
    expected = [resident.engine.run(p, params).token_ids for p in prompts]
    llm = make(tiny_llama, arena=50 * 1024)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert outs[0].stats.num_streamed_heads > 0
    assert outs[0].num_cached_tokens == 0
    assert outs[1].num_cached_tokens == outs[2].num_cached_tokens == 160  # 10 shared pages


def test_swap_out_and_in_keeps_outputs_identical(tiny_llama):
    """A small all-resident pool admits on the prompt's pages; sequences that outgrow it are
    swapped out to host pages and back instead of being refused."""
    prompts = _prompts([60, 50, 70, 40, 65], seed=7)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    expected = [make(tiny_llama).generate(p, params)[0].token_ids for p in prompts]
    llm = make(tiny_llama, num_kv_pages=12)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.stats.num_swaps for o in outs) > 0
    assert all(o.stats.num_streamed_heads == 0 for o in outs)
    assert pools_back(llm.engine)


class CappedArena(HostKVArena):
    """Host pages that cannot grow past 3 pages, as where page-locking is refused."""

    def ensure(self, num_pages: int, *, keep: bool = True, rows: int | None = None) -> bool:
        if num_pages > 3:
            raise UserError("cannot page-lock 1.00 MiB of host memory for KV pages")
        return super().ensure(num_pages, keep=keep, rows=rows)


@pytest.mark.parametrize("short_of", ["budget", "page-locking"])
def test_a_sequence_with_no_host_page_to_swap_out_to_ends_alone(tiny_llama, spec, short_of):
    """Five requests outgrow 12 pages while the host pages hold 3: the host budget has
    room for no more, or it has but no more can be page-locked (the arena refuses to grow
    after the step was planned). A sequence that must swap out and finds no host page ends
    alone (finish reason "error", "no pages"), never the step or the others; the others,
    swapped out and back or not, give their tokens run alone; every page goes back, the
    host pool holds no page the arena lacks, and the next request runs."""
    prompts = _prompts([60, 50, 70, 40, 65], seed=7)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    options = ({"host_memory": 3 * spec.full_page_bytes} if short_of == "budget"
               else {"hooks": EngineHooks(host_arena=CappedArena)})  # fmt: skip
    llm = make(tiny_llama, num_kv_pages=12, **options)
    outputs = llm.generate(prompts, params)
    ended = [o for o in outputs if o.finish_reason == "error"]
    assert ended and len(ended) < len(prompts)
    assert all(o.stats.ended == "no pages" for o in ended)
    alone = make(tiny_llama)
    for prompt, output in zip(prompts, outputs, strict=True):
        if output.finish_reason != "error":
            assert output.token_ids == alone.generate(prompt, params)[0].token_ids
    assert pools_back(llm.engine)
    assert llm.engine.load().lane("resident").host_pages <= 3  # none the arena lacks
    short = SamplingParams(max_new_tokens=8, ignore_eos=True)
    assert llm.generate(prompts[0], short)[0].token_ids == \
        alone.generate(prompts[0], short)[0].token_ids  # fmt: skip


def test_a_layout_whose_host_pages_cannot_be_page_locked_ends_its_longest_request(tiny_llama):
    """Requests that stream heads need more host pages than can be page-locked (3): the
    layout is refused, the request it was for that may grow longest ends alone (finish
    reason "error", "no pages"), the others are planned again; those that fit the GPU run
    as alone, every page goes back."""
    prompts = _prompts([180, 12, 30, 7, 25])
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    alone = make(tiny_llama)
    expected = [alone.generate(p, params)[0].token_ids for p in prompts]
    llm = make(tiny_llama, arena=60 * 1024, hooks=EngineHooks(host_arena=CappedArena))
    outputs = llm.generate(prompts, params)
    assert outputs[0].finish_reason == "error" and outputs[0].stats.ended == "no pages"
    for output, tokens in zip(outputs, expected, strict=True):
        assert output.finish_reason == "error" or output.token_ids == tokens
    assert [o.token_ids for o in (outputs[1], outputs[3])] == [expected[1], expected[3]]
    assert pools_back(llm.engine)


def test_without_a_host_tier_a_request_beyond_the_pool_is_refused(tiny_llama):
    llm = make(tiny_llama, num_kv_pages=4, offload="none")
    with pytest.raises(UserError, match="allow offload"):
        llm.generate(_prompts([70])[0], SamplingParams(max_new_tokens=10))
    llm = make(tiny_llama, num_kv_pages=4)
    out = llm.generate(_prompts([70])[0], SamplingParams(max_new_tokens=10))[0]
    assert out.stats.num_streamed_heads > 0 and len(out.token_ids) >= 1


def test_embedded_model_with_streamed_heads(embedded_dir):
    ids = LLM().tokenizer("Streaming heads from host memory keeps results exact. " * 30)[
        "input_ids"
    ]
    reference = LLM(prefill_chunk=128).logits(ids)
    llm = LLM(prefill_chunk=128, gpu_memory="575MB")
    assert (llm.logits(ids) - reference).abs().max().item() <= 1e-4
    plan = llm.engine.load().lane("offload").plan  # (it does not fit the GPU alone)
    assert 0 < plan.head_map.count("gpu") < 90


@pytest.mark.parametrize("offload", ["layer", "hybrid"])
def test_a_bound_on_the_keys_a_prompt_kernel_reads_keeps_the_logits(tiny_llama, spec, prompt,
                                                                     offload):  # fmt: skip
    """``prefill_key_span`` cuts a prompt piece's attention over its prefix into runs of at
    most that many keys (resident prefix pieces and staged history alike): the logits stay
    those of the unbounded run, within rounding."""
    arena = 6 * spec.full_page_bytes
    unbounded = make(tiny_llama, arena=arena, offload=offload).logits(prompt[:400])
    spans = make(tiny_llama, arena=arena, offload=offload, prefill_key_span=40)
    assert spans.engine.config.runtime.prefill_key_span == 40
    torch.testing.assert_close(spans.logits(prompt[:400]), unbounded, atol=1e-4, rtol=0)
    resident = make(tiny_llama, prefill_key_span=40).logits(prompt[:400])
    torch.testing.assert_close(resident, unbounded, atol=1e-4, rtol=0)


def test_streamed_prefill_sums_in_the_resident_order_where_the_pieces_agree(tiny_llama, spec,
                                                                             prompt):  # fmt: skip
    """The stream tier merges its staged pieces of a chunk's prefix into the chunk's running
    result one after the other; the resident tier merges its prefix pieces the same way, so
    with pieces of the same pages the two are bit-identical (with the default pieces they
    differ by rounding only: the staging slot's pieces are sized by memory)."""
    from headspace.engine.hooks import EngineHooks

    streamed = make(tiny_llama, arena=6 * spec.full_page_bytes, offload="layer")
    got = streamed.logits(prompt[:400])
    tiers = streamed.engine.lanes.lane("offload").runner.tiers
    tier = next(t for t in tiers if isinstance(t, StreamedTier))
    assert tier.piece_pages * PAGE < 400  # the prefix spans several staged pieces
    pieces = EngineHooks(prefix_piece=tier.piece_pages * PAGE)
    assert torch.equal(make(tiny_llama, hooks=pieces).logits(prompt[:400]), got)
    close = make(tiny_llama).logits(prompt[:400])  # one piece of up to 32K tokens
    torch.testing.assert_close(close, got, atol=1e-4, rtol=0)

"""The server's warm-up: every decode batch bucket up to its bound, the decode graph of every
width its prompts meet, and the offload lane laid out for the whole context, run before users
come (so that no compile stands between them and their tokens)."""

from __future__ import annotations

import re

import pytest

from graph_twin import EagerGraphTwin
from headspace import LLM, SamplingParams
from headspace.engine.step_plan import StepPlan
from headspace.errors import UserError
from test_lanes import _engine, _prompt


def test_a_warm_up_decodes_every_batch_bucket_up_to_its_bound(tiny_llama):
    """A server's warm-up (``batch`` = its bound on concurrent requests) decodes batches of
    every bucket up to the bound (its steps' sizes seen from the lane's last step), so no
    decode step of a new bucket compiles while users wait."""
    from headspace.engine.hooks import EngineHooks
    from headspace.engine.warm_shapes import warm_up_batches

    assert warm_up_batches(1, 64) == [] and warm_up_batches(100, 64) == [2, 4, 8, 16, 32, 64]
    assert warm_up_batches(5, 64) == [2, 4, 5]  # 5 in the bucket of 8
    sizes = set()
    llm = LLM(str(tiny_llama), hooks=EngineHooks(lane_step=lambda name: sizes.add(
        len((llm.engine.lanes.lane(name).last_step or StepPlan()).decode))))  # fmt: skip
    lines = []
    llm.engine.warm_up(batch=5, report=lines.append)
    assert {1, 2, 3, 4, 5} <= sizes and max(sizes) == 5  # buckets 1, 2, 4 and 8
    assert [line.split(" (")[0] for line in lines] == [
        f"warm-up: decode batch {n}" for n in (2, 4, 5)
    ]  # a progress line each


@pytest.mark.parametrize("mode", ["streamed", "hybrid", "budgets"])
def test_a_warm_up_runs_the_offload_lane_laid_out_for_the_whole_context(tiny_llama, mode):
    """With ``offload``, a warm-up also runs its prompt through the offload lane as a request
    that may grow to the whole context (512 tokens: 32 pages, the arena holds 11): it
    prefills and decodes there with heads streamed (or attended on the CPU), so that their
    kernels compile before users come, then it is aborted, every page goes back and the
    resident lane has the whole arena again; a request after it runs as on an engine
    never warmed. An engine without an offload lane (per-entry pages under a KV budget)
    has none to warm."""
    from headspace.engine.hooks import EngineHooks
    from headspace.engine.warm_shapes import WARM_UP_DECODE_TOKENS

    offloaded = []  # entries offloaded in each of the offload lane's steps

    def look(name: str) -> None:
        if name == "offload":
            plan = llm.engine.lanes.lane("offload").runner.plan
            offloaded.append(0 if plan is None else plan.head_map.num_offloaded)

    llm = _engine(tiny_llama, mode, hooks=EngineHooks(lane_step=look))
    lines = []
    llm.engine.warm_up(report=lines.append, offload=True)
    engine, warmed = llm.engine, list(offloaded)
    assert engine.load().requests == ()
    for lane in engine.load().lanes:
        assert lane.gpu_pages_used == lane.host_pages_used == 0, lane
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    after = engine.run(_prompt(190), params).token_ids
    assert after == _engine(tiny_llama, mode).engine.run(_prompt(190), params).token_ids
    if mode == "budgets":
        assert warmed == [] and not any("offload" in line for line in lines)
        return
    assert lines[-1] == "warm-up: the offload lane, laid out for the whole context"
    steps = [count for count in warmed if count > 0]  # (a step that lays out has no plan yet)
    assert len(steps) > WARM_UP_DECODE_TOKENS and len(steps) >= len(warmed) - 1
    assert engine.load().lane("resident").gpu_pages == 11  # the arena whole again


@pytest.mark.parametrize("alone", [190 + 8, None])
def test_the_clis_warm_up_lays_the_offload_lane_out_as_its_request_will_be(tiny_llama, alone):
    """``generate``'s warm-up (``alone``: its request's prompt and new tokens) runs its
    prompt through the offload lane laid out as the request will be, so that the request's
    prefill meets no layout, kernel or host page it has not met; laid out for requests of
    the whole context arriving one by one (None, a server's), the offload lane holds
    another. The request streamed lays out as the same one generated (given alone: no
    resident reserve kept for requests that cannot come)."""
    from headspace.engine.hooks import EngineHooks

    layouts = []  # the offload lane's head map at each of its steps

    def look(name: str) -> None:
        plan = llm.engine.lanes.lane(name).runner.plan
        if name == "offload" and plan is not None:
            layouts.append(plan.head_map.summary())

    llm = _engine(tiny_llama, "streamed", hooks=EngineHooks(lane_step=look))
    prompt, params, lines = _prompt(190), SamplingParams(max_new_tokens=8, ignore_eos=True), []
    llm.engine.warm_up(len(prompt), report=lines.append, offload=True, alone=alone)
    assert lines[-1].endswith("198 tokens" if alone else "the whole context")
    warmed, layouts[:] = layouts[-1], []
    "".join(llm.stream(prompt, params))  # (as the generate command runs it)
    assert llm.last_output.stats.lane == "offload" and layouts
    assert (set(layouts) == {warmed}) == (alone is not None), (warmed, set(layouts))
    streamed, layouts[:] = set(layouts), []
    llm.generate(prompt, params)
    assert set(layouts) == streamed
    if alone:  # a request past the context is laid out for the context (it is refused)
        llm.engine.warm_up(len(prompt), report=lines.append, offload=True, alone=10**6)
        assert lines[-1].endswith("the whole context")


def test_a_warm_up_skips_the_offload_lane_where_no_plan_holds_the_whole_context(tiny_llama):
    """A host budget too small for a request of the whole context: the warm-up leaves the
    offload lane alone (such a request is refused with the numbers when it comes) instead
    of stopping the server's start."""
    llm = _engine(tiny_llama, "streamed", host_memory="60KB")  # (an arena of 150 KiB)
    lines = []
    llm.engine.warm_up(report=lines.append, offload=True)
    assert lines == [] and llm.engine.load().requests == ()
    with pytest.raises(UserError, match="more than the .* host budget"):
        llm.engine.check_request(_prompt(20), SamplingParams(max_new_tokens=480))


class _Captures(EagerGraphTwin):
    """The graphs' CPU twin, recording each decode key it captures with the graphs that
    captured it (a test's hook)."""

    made: list[tuple] = []  # (graphs, key)

    def _capture(self, key):
        if key[0] != "mixed":
            type(self).made.append((self, key))
        return super()._capture(key)


@pytest.mark.parametrize("offload", ["none", "head"])
def test_a_server_warm_up_captures_every_decode_width_its_prompts_meet(tiny_llama, offload):
    """With ``shapes`` (a server's warm-up), a warm-up of a 145-token prompt (a chunk of 128
    and 17; 19 pages of 8 tokens) and decode batches to 4 leaves the resident lane's decode
    graphs (their CPU twin) captured at every batch bucket (1, 2, 4) and width bucket (8,
    16 and 32 pages a row), the offload lane laid out and run after them where there is
    one; requests within that length, alone and three at a time, then capture nothing."""
    from headspace.engine.hooks import EngineHooks
    from headspace.model.config import load_config
    from headspace.planner.memory import decode_bytes, weight_bytes, working_bytes

    _Captures.made = []
    config, budget = load_config(tiny_llama), None
    if offload == "head":  # an arena of 150 KiB: 22 pages of 8 tokens, not the whole context
        budget = (weight_bytes(config, 4) + working_bytes(config, 128, 4)
                  + decode_bytes(config, 64, 4) + 150 * 1024)  # fmt: skip
    llm = LLM(str(tiny_llama), prefill_chunk=128, page_size=8, gpu_memory=budget,
              offload=offload, hooks=EngineHooks(graphs=_Captures))  # fmt: skip
    lines = []
    llm.engine.warm_up(128 + 17, batch=4, report=lines.append, offload=True, shapes=True)
    offloaded = "warm-up: the offload lane, laid out for the whole context"
    assert (lines[-1] == offloaded) == (offload == "head")
    graphs = llm.engine.lanes.resident.runner.graphs
    keys = {(batch, width, 0) for batch in (1, 2, 4) for width in (8, 16, 32)}
    assert {key for made, key in _Captures.made if made is graphs} == keys
    said = r"warm-up: decode graphs of 3 widths, 8 to 32 pages a row, batch buckets 1 to 4: [1-8] "
    assert any(re.match(said + "captured", line) for line in lines)  # (what the batches left)
    captured = len(_Captures.made)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    llm.engine.run(_prompt(140), params)
    llm.engine.generate_batch([_prompt(n) for n in (20, 90, 140)], [params] * 3)
    assert len(_Captures.made) == captured


def test_the_warm_ups_shapes_are_those_its_prompts_meet():
    """The decode keys: every batch bucket of the warm-up's batches (and 1) at every width
    bucket to the prompt's (a chunk of 8,192 and 17 tokens in pages of 64: 129 pages, in
    the bucket of 256). The causal squares cuDNN runs padded for a piece of up to a chunk:
    a piece of 3 to ``chunk`` tokens not exactly its rows meets one of them, and each is
    met (no cuDNN off a GPU: nothing built)."""
    import torch

    from headspace.attention.sdpa import causal_plan_rows, cudnn_rows, warm_causal_plans
    from headspace.engine.warm_shapes import decode_graph_keys, warm_up_batches

    keys = decode_graph_keys(8192 + 17, 64, warm_up_batches(64, 64))
    assert keys == [(1 << b, 8 << w) for b in range(7) for w in range(6)]  # 42 keys
    assert decode_graph_keys(145, 8, [2, 4, 5]) == [
        (batch, width) for batch in (1, 2, 4, 8) for width in (8, 16, 32)
    ]
    assert decode_graph_keys(20, 64, []) == [(1, 8)]
    assert causal_plan_rows(128) == [4, 8, 16, 32, 64, 128]
    assert causal_plan_rows(1000) == [4, 8, 16, 32, 64, 128, 256, 512, 768, 1024]
    assert len(causal_plan_rows(8192)) == 7 + 31  # powers of two to 256, then 512 to 8,192
    for chunk in (100, 256, 1000, 8192):
        padded = {cudnn_rows(n) for n in range(3, chunk + 1) if cudnn_rows(n) != n}
        assert padded == set(causal_plan_rows(chunk))
    assert warm_causal_plans(8, 2, 32, torch.bfloat16, "cpu", 256) == 0


class _MixedCaptures(EagerGraphTwin):
    """The graphs' CPU twin, recording each mixed key it captures (a test's hook)."""

    made: list[tuple] = []

    def _capture(self, key):
        if key[0] == "mixed":
            type(self).made.append(key)
        return super()._capture(key)


def test_a_server_warm_up_captures_the_mixed_pieces_a_burst_meets(tiny_llama):
    """With mixed steps, a server's warm-up also captures the mixed step of every piece the
    scheduler's cap gives beside each batch bucket (:func:`mixed_pieces`), and requests
    arriving one by one beside decoding ones then run every piece through a graph captured
    before (none captured while they run). Rates that make the cap bind on the tiny model
    (a layer's weights read as long as 20 prompt tokens, a context token's K/V 0.033 of
    one; a token's attention over 152 earlier ones as long as its linear layers; the
    default cap, 1.5): beside 1 row of its whole context (512 tokens) a layer of the decode
    step costs 36.8, the piece 0.5 x 36.8 + 19 = 37.4, which holds 32 tokens (35.4) but not
    40 (45.3); beside 4 rows (2,048 tokens) 87.4 and 59.7, which holds 48: pieces of 1 to 5
    pages (7 beside 4 rows), the last page for a prompt's last piece."""
    from headspace.engine.hooks import EngineHooks
    from headspace.planner.memory import Hardware

    _MixedCaptures.made = []
    rates = Hardware(prompt_flops=10 * 3.0e12, hbm_bytes=3.0e12)  # weights: 2 x 10 tokens
    llm = LLM(str(tiny_llama), prefill_chunk=128, page_size=8, offload="none", mixed_steps=True,
              hooks=EngineHooks(graphs=_MixedCaptures, hardware=rates))  # fmt: skip
    llm.engine.warm_up(128 + 17, batch=4, offload=True, shapes=True)
    scheduler = llm.engine.lanes.resident.scheduler
    assert llm.engine.max_context == 512 and scheduler.blocks.pool.num_pages * 8 >= 4 * 512
    assert [scheduler.widest_mixed_piece(b, b * 512) for b in (1, 2, 4)] == [32, 32, 48]
    graphs = llm.engine.lanes.resident.runner.graphs
    pieces = [(rows, batch) for batch, most in ((1, 40), (2, 40), (4, 56))
              for rows in range(8, most + 1, 8)]  # fmt: skip
    assert set(_MixedCaptures.made) == {graphs._mixed_key(r, b) for r, b in pieces}
    captured = len(_MixedCaptures.made)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    running = [llm.engine.add_request(_prompt(n), params) for n in (20, 30)]
    while not all(llm.engine.load().request(r).generated_tokens for r in running):
        llm.engine.step()
    mixed = 0
    for length in (26, 140):
        llm.engine.add_request(_prompt(length), SamplingParams(max_new_tokens=2, ignore_eos=True))
        while len(llm.engine.load().requests) > 2:
            llm.engine.step()
            mixed += llm.engine.load().lane("main").last_step["mixed"]
    assert mixed >= 1 + 140 // 32 and len(_MixedCaptures.made) == captured


def test_the_mixed_pieces_grow_with_the_rows_context_within_the_arena():
    """:func:`mixed_pieces` asks for the widest piece beside each batch bucket at its rows'
    longest (each of ``row_tokens``, ``arena_tokens`` in all) and adds a page: here a
    widest piece of a page per 100 context tokens, rows of 100 tokens, 300 in the arena."""
    from headspace.engine.warm_shapes import mixed_pieces

    asked = []

    def widest(rows: int, context: int) -> int:
        asked.append((rows, context))
        return context // 100 * 8

    pieces = mixed_pieces(widest, 100, 300, 8, [2, 4])
    assert asked == [(1, 100), (2, 200), (4, 300)]
    assert pieces == [(rows, batch) for batch, most in ((1, 16), (2, 24), (4, 32))
                      for rows in range(8, most + 1, 8)]  # fmt: skip

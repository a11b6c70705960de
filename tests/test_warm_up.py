"""The server's warm-up: every decode batch bucket up to its bound, and the offload lane laid
out for the whole context, run before users come (so that no compile stands between them and
their tokens)."""

from __future__ import annotations

import pytest

from headspace import LLM, SamplingParams
from headspace.engine.step_plan import StepPlan
from headspace.errors import UserError
from test_lanes import _engine, _prompt


def test_a_warm_up_decodes_every_batch_bucket_up_to_its_bound(tiny_llama):
    """A server's warm-up (``batch`` = its bound on concurrent requests) decodes batches of
    every bucket up to the bound (its steps' sizes seen from the lane's last step), so no
    decode step of a new bucket compiles while users wait."""
    from headspace.engine.engine import warm_up_batches
    from headspace.engine.hooks import EngineHooks

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
    from headspace.engine.engine import WARM_UP_DECODE_TOKENS
    from headspace.engine.hooks import EngineHooks

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

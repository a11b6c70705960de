"""The hybrid tier: older tokens of offloaded heads attended by CPU threads in host pages,
merged by LSE with what streams to the GPU; every split equals the all-resident run."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import plan_of
from headspace import SamplingParams, UserError
from headspace.engine.hooks import EngineHooks
from headspace.planner.memory import balanced_share
from headspace.tiers.hybrid import cpu_ends
from test_offload import GREEDY, _prompts, make


def test_cpu_ends_split_before_the_window_on_page_boundaries():
    assert cpu_ends([1000, 100, 0], 1.0, 64, 16) == [928, 32, 0]
    assert cpu_ends([1000], 0.5, 64, 16) == [464]  # half of the 936 before the window
    assert cpu_ends([1000], 0.0, 64, 16) == [0]
    assert cpu_ends([50], 1.0, 64, 16) == [0]  # all inside the window


def test_balanced_share_finishes_both_together():
    share = balanced_share(30e9, 60e9)
    assert share == pytest.approx(1 / 3)
    history = 9e9  # bytes: the CPU's part at its rate takes as long as PCIe's at its own
    assert share * history / 30e9 == pytest.approx((1 - share) * history / 60e9)


def cpu_tokens(timings) -> int:
    """Tokens the CPU kernel attended per kv head, over every call and background job of a
    :class:`headspace.tiers.cpu_timings.CpuTimings`."""
    return sum(call.tokens for call in timings.calls)


def decode_logits(llm, prompt: list[int], steps: int) -> torch.Tensor:
    """fp32 logits ``[steps - 1, vocab]`` of each greedy decode step."""
    hooks, seen = llm.engine.lanes.hooks, []  # (every lane's runner runs them)

    def recording(seq_ids, step):
        logits, slots = step()
        seen.append(logits.clone())
        return logits, slots

    hooks.decode_hooks.append(recording)
    llm.generate(prompt, SamplingParams(max_new_tokens=steps, ignore_eos=True))
    hooks.decode_hooks.remove(recording)
    return torch.cat(seen)


@pytest.mark.parametrize(
    "arena_kib,options",
    [
        (700, {"cpu_share": 1.0, "gpu_window": 16}),  # CPU only before one page of window
        (700, {"cpu_share": 1.0, "gpu_window": 40, "head_group": 1}),
        (700, {"cpu_share": 0.5, "gpu_window": 16}),  # PCIe and CPU split the history
        (100, {"cpu_share": 0.3, "gpu_window": 1}),  # the streamed part in pieces
        (10, {"cpu_share": 1.0, "gpu_window": 16}),  # every entry offloaded
    ],
)
def test_hybrid_equals_all_resident(wide_llama, prompt, cpu_timings, arena_kib, options):
    resident = make(wide_llama)
    expected = resident.generate(prompt, GREEDY)[0].token_ids
    llm = make(wide_llama, arena=arena_kib * 1024, offload="hybrid",
               hooks=EngineHooks(cpu_timings=cpu_timings), **options)  # fmt: skip
    out = llm.generate(prompt, GREEDY)[0]
    assert out.token_ids == expected
    plan = plan_of(llm)
    assert plan.offload == "hybrid" and plan.head_map.count("stream") == 0
    assert out.stats.num_hybrid_heads == plan.head_map.count("hybrid") > 0
    assert f"{out.stats.num_hybrid_heads} hybrid" in out.stats.summary()
    assert cpu_tokens(cpu_timings) > 0  # the CPU attended part of every decode step
    gap = decode_logits(llm, prompt, 64) - decode_logits(resident, prompt, 64)
    assert gap.abs().max().item() < 1e-4  # every decode step's logits, not only the argmax


def test_cpu_share_zero_streams_everything(wide_llama, prompt, cpu_timings):
    expected = make(wide_llama).generate(prompt, GREEDY)[0].token_ids
    llm = make(wide_llama, arena=700 * 1024, offload="hybrid", cpu_share=0.0,
               hooks=EngineHooks(cpu_timings=cpu_timings))  # fmt: skip
    assert llm.generate(prompt, GREEDY)[0].token_ids == expected
    assert cpu_timings.calls == []  # no kernel call, no background job


def frozen_clock() -> float:
    """A step clock that never moves: every share times alike, so the search keeps its start."""
    return 0.0


def test_the_share_starts_at_the_planners_rates(wide_llama, prompt):
    """Without ``cpu_share`` the split starts at the rates' balance: the defaults' (0.50),
    or a machine's whose CPU reads twice as fast as PCIe carries (2/3: more of each history
    on the CPU, fewer tokens staged); the request's summary shows the share, and the tokens
    are the all-resident run's either way."""
    from headspace.planner.memory import Hardware

    expected = make(wide_llama).generate(prompt, GREEDY)[0].token_ids
    shares = {}
    fast_cpu = Hardware(cpu_attention_bytes=108e9, h2d_bytes=54e9)
    for name, hardware in (("default", None), ("fast CPU", fast_cpu)):
        llm = make(wide_llama, arena=700 * 1024, offload="hybrid",
                   hooks=EngineHooks(hardware=hardware, step_clock=frozen_clock))  # fmt: skip
        out = llm.generate(prompt, GREEDY)[0]
        assert out.token_ids == expected
        shares[name] = plan_of(llm).cpu_share
        assert out.stats.cpu_share == pytest.approx(shares[name], abs=1e-6)
        assert f"(CPU share {shares[name]:.2f})" in out.stats.summary()
    assert shares == {"default": pytest.approx(0.5, abs=0.01), "fast CPU": pytest.approx(2 / 3)}


def share_clock(runners: list, best: float):
    """A step clock that charges each decode step by the share it ran at (the test's
    machine: fastest at ``best``), called as the next step starts; ``clock.shares`` records
    every step's share, ``clock.centres`` where the search stood."""

    def clock() -> float:
        share = runners[0].hybrid_share.step_share
        clock.shares.append(share)
        clock.centres.append(runners[0].cpu_share)
        clock.now += 0.1 + 0.2 * abs(share - best)
        return clock.now

    clock.now, clock.shares, clock.centres = 0.0, [], []
    return clock


def test_the_share_is_searched_from_the_steps_times(wide_llama, prompt, cpu_timings):
    """Without ``cpu_share`` the decode steps' own times move the share: on a machine whose
    steps are fastest with 0.8 of each history on the CPU (the test's clock charges each
    step by the share it ran at), the search goes there from the rates' 0.5 and settles,
    and every step's logits stay the all-resident run's while it moves. A new request
    starts where it stood; a share asked for is never moved."""
    resident = make(wide_llama)
    runners = []
    clock = share_clock(runners, 0.8)
    hooks = EngineHooks(cpu_timings=cpu_timings, step_clock=clock)
    llm = make(wide_llama, arena=700 * 1024, offload="hybrid", gpu_window=16, hooks=hooks)
    runners.append(llm.engine.lanes.lane("offload").runner)
    gap = decode_logits(llm, prompt, 120) - decode_logits(resident, prompt, 120)
    assert gap.abs().max().item() < 1e-4
    search = runners[0].hybrid_share.search
    assert search.settled and search.share == pytest.approx(0.8, abs=0.05)
    assert len(set(clock.shares)) > 3  # it timed several shares on the way
    out = llm.generate(prompt, GREEDY)[0]
    assert out.stats.cpu_share == pytest.approx(0.8, abs=0.05)
    asked = make(wide_llama, arena=700 * 1024, offload="hybrid", gpu_window=16, cpu_share=0.5,
                 hooks=EngineHooks(step_clock=clock))  # fmt: skip
    runners[0] = asked.engine.lanes.lane("offload").runner
    assert asked.generate(prompt, GREEDY)[0].stats.cpu_share == 0.5
    assert runners[0].hybrid_share.search is None


def test_a_short_generation_runs_at_the_start_and_reports_it(wide_llama, prompt):
    """A batch's steps within the search's warm-up never probe: a short generation runs
    every step at the rates' share; a longer one then probes, and the summary reports where
    the search stands, not a neighbour being timed."""
    runners = []
    clock = share_clock(runners, 0.8)
    llm = make(wide_llama, arena=700 * 1024, offload="hybrid", gpu_window=16,
               hooks=EngineHooks(step_clock=clock))  # fmt: skip
    runners.append(llm.engine.lanes.lane("offload").runner)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    share = llm.generate(prompt, params)[0].stats.cpu_share
    start = runners[0].plan.cpu_share
    assert share == pytest.approx(start, abs=1e-6) and set(clock.shares) == {share}
    out = llm.generate(prompt, SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    assert len(set(clock.shares)) > 1  # probing began; the summary reports the centre
    assert out.stats.cpu_share == runners[0].hybrid_share.search.share == runners[0].cpu_share
    assert set(clock.shares) - set(clock.centres)  # and some steps ran at a neighbour


def test_a_prefill_between_steps_is_not_timed(wide_llama, prompt):
    """A decode step with a prefill chunk run since the one before is not timed: a machine
    whose prefill chunks take long would otherwise charge them to the share just tried."""
    runners, ran = [], []

    def clock() -> float:  # whether something ran since the last decode step, as it starts
        ran.append(runners[0].hybrid_share.other_work)
        return 0.0

    llm = make(wide_llama, arena=700 * 1024, offload="hybrid", gpu_window=16,
               hooks=EngineHooks(step_clock=clock))  # fmt: skip
    runners.append(llm.engine.lanes.lane("offload").runner)
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
    for _ in range(6):
        engine.step()
    other = [(t * 7 + 3) % 30000 for t in prompt]  # no prefix in common
    engine.add_request(other, SamplingParams(max_new_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert ran[0] and ran.count(True) >= 2  # after each prompt's prefill
    assert ran.count(False) > 10


def test_hybrid_batch_equals_one_at_a_time(tiny_llama, cpu_timings):
    prompts = _prompts([180, 12, 30, 7, 25])
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    resident = make(tiny_llama)
    expected = [resident.generate(p, params)[0].token_ids for p in prompts]
    llm = make(tiny_llama, arena=60 * 1024, offload="hybrid", cpu_share=1.0, gpu_window=16,
               hooks=EngineHooks(cpu_timings=cpu_timings))  # fmt: skip
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert any(o.stats.num_hybrid_heads > 0 for o in outs) and cpu_tokens(cpu_timings) > 0


@pytest.mark.parametrize(
    "options",
    [{"cpu_share": 1.5}, {"cpu_share": "0.5"}, {"gpu_window": 0}, {"cpu_threads": 0},
     {"cpu_threads": True}],
)  # fmt: skip
def test_bad_hybrid_options_are_refused(tiny_llama, options):
    with pytest.raises(UserError):
        make(tiny_llama, offload="hybrid", **options)


def test_sampled_tokens_equal_too(wide_llama, prompt):
    params = SamplingParams(max_new_tokens=32, temperature=1.0, seed=3, ignore_eos=True)
    expected = make(wide_llama).generate(prompt, params)[0].token_ids
    llm = make(wide_llama, arena=700 * 1024, offload="hybrid", cpu_share=1.0, gpu_window=16)
    assert llm.generate(prompt, params)[0].token_ids == expected


def test_the_planner_prices_the_split():
    """Decode roofline with the hybrid tier: PCIe carries 1 - share of the offloaded bytes
    while the CPU reads the rest; at the rates' balance both take the same time."""
    from headspace.kv.spec import GiB
    from headspace.model.config import config_from_dict
    from headspace.planner import PlanRequest, make_plan
    from headspace.planner.memory import Hardware

    config = config_from_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128256, "max_position_embeddings": 131072,
    })  # fmt: skip
    hw = Hardware(h2d_bytes=50e9, cpu_attention_bytes=50e9, hybrid_layer_seconds=1e-3)

    def plan(**options):
        return make_plan(config, PlanRequest(131072, 23 * GiB, 200 * GiB, **options), hw)

    streamed, hybrid = plan(offload="head"), plan(offload="hybrid")
    entry_ms = streamed.decode_ms / streamed.head_map.count("stream")  # PCIe-bound at 128K
    floor = hybrid.head_map.count("hybrid") * entry_ms
    assert hybrid.head_map.count("stream") == 0
    assert hybrid.decode_pcie_floor_ms == pytest.approx(floor)
    handoff = 32.0  # every layer holds hybrid heads: 1 ms each
    # share 0.5: both halves at once, then the hand-offs
    assert hybrid.decode_ms == pytest.approx(floor / 2 + handoff)
    for share in (0.0, 1.0):
        one_side = plan(offload="hybrid", cpu_share=share)
        assert one_side.decode_ms == pytest.approx(one_side.decode_pcie_floor_ms + handoff)


def test_hybrid_staging_holds_what_streams_of_a_layer():
    """At decode the hybrid tier stages 1 - share of each history before the window, and
    the window: one group per layer covers all its offloaded heads in slots of that size
    (more resident heads fit than with whole-history slots of one head each)."""
    from headspace.kv.spec import GiB, KVSpec
    from headspace.planner.plan import plan_batch

    spec = KVSpec(32, 8, 128, 128, 2)
    pages = 1024  # 128K tokens
    for share, window in ((0.5, 1024), (0.25, 4096), (1.0, 1024)):
        plan = plan_batch(spec, 7 * GiB, pages, offload="hybrid", cpu_share=share,
                          gpu_window=window)  # fmt: skip
        head_map, staging = plan.head_map, plan.staging
        streamed = math.ceil((1 - share) * pages) + window // 128 + 2  # +2: the split's pages
        assert staging.piece_pages == min(pages, streamed)
        for layer in range(spec.num_layers):
            assert len(head_map.offloaded_groups(layer)) == 1  # one copy and launch per layer
        assert staging.group == max(len(head_map.heads(layer, "hybrid")) for layer in range(32))
        assert staging.num_bytes <= 7 * GiB // 2
    # the user's group size is kept, within the heads a layer offloads
    assert plan_batch(spec, 7 * GiB, pages, offload="hybrid", head_group=2).staging.group == 2
    wide = plan_batch(spec, 7 * GiB, pages, offload="hybrid", head_group=50)
    offloaded = max(len(wide.head_map.heads(layer, "hybrid")) for layer in range(32))
    assert wide.staging.group <= offloaded
    # a batch stages each sequence's window
    batch = plan_batch(spec, 7 * GiB, pages, offload="hybrid", cpu_share=1.0, num_seqs=4)
    assert batch.staging.piece_pages == 4 * (1024 // 128 + 2) and batch.cpu_share == 1.0


def test_auto_picks_the_hybrid_tier_where_it_is_predicted_faster():
    """``offload="auto"``: hybrid where halving the bytes on each path outweighs the
    hand-offs (a long history), streaming for a short one or without CPU attention."""
    from headspace.kv.spec import GiB, KVSpec
    from headspace.planner.memory import Hardware
    from headspace.planner.plan import plan_batch

    spec = KVSpec(32, 8, 128, 128, 2)  # Llama-3-8B's KV: 64 KiB per entry page
    hw = Hardware(h2d_bytes=50e9, cpu_attention_bytes=50e9, hybrid_layer_seconds=1e-3)
    # 128K tokens (1024 pages) in a 7 GiB arena: ~170 entries offloaded, ~11 GB per step:
    # 220 ms streamed, 110 + 32 ms hybrid
    long = plan_batch(spec, 7 * GiB, 1024, hw=hw)
    assert long.offload == "hybrid" and long.head_map.count("stream") == 0
    assert long.head_map.count("hybrid") > 0 and "hybrid=" in long.head_map.summary()
    assert "H0" in long.head_map.grid()
    # 2K tokens (16 pages) in a 30 MiB arena: ~1 ms streamed, far below 32 ms of hand-offs
    short = plan_batch(spec, 30 * 2**20, 16, hw=hw)
    assert short.offload == "head" and short.head_map.count("stream") > 0
    no_cpu = Hardware(cpu_attention_bytes=0)
    assert plan_batch(spec, 7 * GiB, 1024, hw=no_cpu).offload == "head"
    assert plan_batch(spec, 7 * GiB, 1024, offload="head", hw=hw).offload == "head"
    assert plan_batch(spec, 7 * GiB, 1024, hw=hw, auto_hybrid=False).offload == "head"
    # the share asked for is the one priced: nothing on the CPU gains nothing
    assert plan_batch(spec, 7 * GiB, 1024, hw=hw, cpu_share=0.0).offload == "head"
    # asked for without CPU attention: a plan, its CPU part never ending (no division by zero)
    hybrid = plan_batch(spec, 7 * GiB, 1024, hw=no_cpu, offload="hybrid", cpu_share=0.5)
    assert hybrid.offload == "hybrid" and hybrid.cpu_share == 0.5
    from headspace.planner.memory import offloaded_seconds

    assert math.isinf(offloaded_seconds(1e9, 4, True, 0.5, no_cpu))

"""The stepping engine: requests added between steps, aborted at any step, and long prompts
prefilled in pieces between the decode steps of the others, in every tier mode.

Each mode runs the tiny Llama-3 (3 layers x 2 kv heads, fp32) through a small arena, so the
running batch streams heads, attends on the CPU, swaps sequences out, or keeps per-head
budgets; prompts are prefilled in pieces of one page while others decode (in one forward
with their decode rows, in the mixed mode).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graph_twin import EagerGraphTwin
from headspace import LLM, SamplingParams
from headspace.engine.engine import Engine
from headspace.engine.hooks import EngineHooks
from headspace.engine.paged_graphs import GraphSite
from headspace.errors import UserError

PAGE, CHUNK = 16, 64
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
LENGTHS = [150, 30, 60, 45]  # the first streams in the small arenas; each crosses a page
MODES = {  # name: engine options (an arena in KiB: the KV the GPU budget leaves)
    "resident": {"offload": "none"},
    "streamed": {"arena_kib": 60},
    "hybrid": {"arena_kib": 60, "offload": "hybrid", "cpu_share": 1.0, "gpu_window": 16},
    "budgets": {"kv_budget": 0.5},
    "swap": {"num_kv_pages": 13},
    "mixed": {"offload": "none", "mixed_steps": True},  # a piece and decode rows: one forward
}
SLOW = settings(max_examples=4, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip


def _prompts(lengths: list[int], seed: int = 11) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40000, (n,), generator=generator).tolist() for n in lengths]


def budget_for_kib(checkpoint, arena_kib: int) -> int:
    """The GPU budget whose KV arena is ``arena_kib`` KiB."""
    from test_offload import budget_for

    return budget_for(checkpoint, arena_kib * 1024)


def _make(checkpoint, arena_kib: int | None = None, **options) -> LLM:
    budget = None if arena_kib is None else budget_for_kib(checkpoint, arena_kib)
    return LLM(str(checkpoint), prefill_chunk=CHUNK, page_size=PAGE, gpu_memory=budget,
               prefill_step_tokens=PAGE, **options)  # fmt: skip


@pytest.fixture(scope="module")
def engines(tiny_llama) -> dict[str, Engine]:
    return {name: _make(tiny_llama, **options).engine for name, options in MODES.items()}


@pytest.fixture(scope="module")
def alone(engines) -> dict[str, list[list[int]]]:
    """Each prompt's greedy tokens run alone, per mode."""
    prompts = _prompts(LENGTHS)
    return {name: [engine.run(p, GREEDY).token_ids for p in prompts]
            for name, engine in engines.items()}  # fmt: skip


def _pools_full(engine: Engine) -> bool:
    """Every lane's GPU and host pages back in their pools."""
    return all(lane.gpu_pages_used == lane.host_pages_used == 0 for lane in engine.load().lanes)


def drive(engine: Engine, arrivals: list[int], abort: tuple[int, int] | None = None,
          max_steps: int = 2000) -> tuple[dict[int, list[int]], dict[int, str]]:  # fmt: skip
    """Step ``engine``; prompt ``i`` is added before step ``arrivals[i]``; ``abort``: (which
    prompt, at which step). The final tokens and finish reasons per prompt (``reasons[-1]``:
    the swaps the finished requests made)."""
    prompts = _prompts(LENGTHS)
    ids: dict[int, int] = {}  # request id -> prompt index
    tokens, reasons = {}, {-1: 0}
    for step in range(max_steps):
        for i, at in enumerate(arrivals):
            if at == step:
                ids[engine.add_request(prompts[i], GREEDY)] = i
        if abort is not None and abort[1] == step:
            victim = next((r for r, i in ids.items() if i == abort[0]), None)
            if victim is not None and engine.abort(victim):
                reasons[abort[0]] = "abort"
        for output in engine.step():
            added = len(output.new_token_ids)
            assert output.new_token_ids == output.token_ids[len(output.token_ids) - added :]
            assert added == 1 or (added == 0 and output.finish_reason == "abort")
            if output.finished:
                tokens[ids[output.request_id]] = output.token_ids
                reasons[ids[output.request_id]] = output.finish_reason
                reasons[-1] += output.stats.num_swaps
        if step > max(arrivals) and not engine.has_unfinished():
            return tokens, reasons
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("mode", list(MODES))
@SLOW
@given(arrivals=st.lists(st.integers(0, 40), min_size=len(LENGTHS), max_size=len(LENGTHS)))
def test_requests_added_between_steps_equal_each_alone(engines, alone, mode, arrivals):
    engine = engines[mode]
    tokens, reasons = drive(engine, arrivals)
    assert [tokens[i] for i in range(len(LENGTHS))] == alone[mode]
    assert {reasons[i] for i in range(len(LENGTHS))} == {"length"}
    assert _pools_full(engine)


def test_arrivals_swap_out_and_back(engines, alone):
    """The swap mode's pool is small enough that these arrivals outgrow it."""
    tokens, reasons = drive(engines["swap"], [0, 2, 4, 6])
    assert reasons[-1] > 0
    assert [tokens[i] for i in range(len(LENGTHS))] == alone["swap"]


@pytest.mark.parametrize("mode", list(MODES))
@SLOW
@given(arrivals=st.lists(st.integers(0, 20), min_size=len(LENGTHS), max_size=len(LENGTHS)),
       victim=st.integers(0, len(LENGTHS) - 1), at=st.integers(0, 60))  # fmt: skip
def test_abort_at_any_step_leaves_the_others_and_frees_pages(engines, alone, mode, arrivals,
                                                             victim, at):  # fmt: skip
    engine = engines[mode]
    tokens, reasons = drive(engine, arrivals, abort=(victim, at))
    for i in range(len(LENGTHS)):
        if reasons[i] != "abort":
            assert tokens[i] == alone[mode][i]
    assert not engine.has_unfinished()
    assert _pools_full(engine)  # GPU and host pages back in their pools


def _piece(engine: Engine, lane: str = "resident"):
    """The prompt piece ``lane``'s last step ran: (request id, start, end, layers), or None."""
    step = engine.load().lane(lane).last_step
    return None if step is None else step["prefill"]


def _long_arrival(engine: Engine, mixed: list[bool] | None = None):
    """Two requests decode (60 tokens each); a 400-token prompt arrives asking for 4. Steps
    until its first token, then to the end: (the others' tokens during its prefill, steps
    of its prefill, every request's tokens by id, the long one's id). ``mixed``: each step
    of its prefill, whether it ran as one forward with the decode rows."""
    short = _prompts([20, 30], seed=3)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    running = [engine.add_request(p, params) for p in short]
    tokens = {r: [] for r in running}
    while not all(engine.load().request(r).generated_tokens for r in running):
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    long_id = engine.add_request(_prompts([400], seed=4)[0], FOUR)
    others, steps, tokens[long_id] = 0, 0, []
    while not tokens[long_id]:
        outputs = {o.request_id: o for o in engine.step()}
        steps += 1
        if mixed is not None:
            mixed.append(engine.load().lane("main").last_step["mixed"])
        for request_id, output in outputs.items():
            tokens[request_id] += output.new_token_ids
        others += sum(len(outputs[r].new_token_ids) for r in running if r in outputs)
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    return others, steps, tokens, long_id


FOUR = SamplingParams(max_new_tokens=4, ignore_eos=True)


def test_a_prompt_beside_decoding_requests_runs_in_their_forward(tiny_llama):
    """Two requests decode; a 400-token prompt arrives. In the resident layout each step of
    its prefill runs a piece of it and their decode rows through the layers in one forward
    (``mixed_steps``): pieces of a whole chunk (requests added one by one: each piece as
    large as keeps the step within the slowdown, and at the H100's rates a whole chunk of
    the tiny model's linear layers hides under its weights' read), and they get a token at
    every step (the first, whose token was on its way, aside). The long one's tokens equal
    its prompt's alone, as with two forwards a step, whose prefill takes more steps (a
    chunk's layers a step). (The others' tokens are not compared: this random model's
    near-ties flip with the rows a CPU GEMM is given, with two forwards too.)"""
    llm = _make(tiny_llama, offload="none", mixed_steps=True)
    mixed: list[bool] = []
    others, steps, tokens, long_id = _long_arrival(llm.engine, mixed)
    assert all(mixed[:-1]) and len(mixed) == -(-400 // CHUNK) + 1  # (the last reads its token)
    assert others >= 2 * (steps - 1)
    assert [len(t) for t in tokens.values()] == [60, 60, 4]
    alone = llm.engine.run(_prompts([400], seed=4)[0], FOUR).token_ids
    apart = _make(tiny_llama, offload="none")
    _, steps_apart, tokens_apart, apart_id = _long_arrival(apart.engine)
    assert tokens[long_id] == tokens_apart[apart_id] == alone
    assert steps < steps_apart
    assert _pools_full(llm.engine)


def test_a_long_prompt_prefills_between_the_others_tokens(tiny_llama):
    """Two requests decode; a 400-token prompt arrives. With two forwards a step (the
    default) the resident layout lets a chunk run a few layers a step: its 7
    chunks of 64 tokens run about a layer a step (a prompt work of 16 tokens a step)
    between their decode steps, and they get a token at nearly every step of its prefill.
    Its tokens equal those of its prompt alone (whole chunks)."""
    llm = _make(tiny_llama, offload="none")
    engine = llm.engine
    short = _prompts([20, 30], seed=3)
    long_prompt = _prompts([400], seed=4)[0]
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    running = [engine.add_request(p, params) for p in short]
    while not all(engine.load().request(r).generated_tokens for r in running):
        engine.step()
    four = SamplingParams(max_new_tokens=4, ignore_eos=True)
    long_id = engine.add_request(long_prompt, four)
    others_tokens, long_tokens, part_way = 0, [], 0
    while not long_tokens:
        outputs = {o.request_id: o for o in engine.step()}
        piece = _piece(engine, "main")
        part_way += piece is not None and piece[3][1] < 3  # a chunk between its layers
        if long_id in outputs:  # its first token: the prefill is over
            long_tokens = outputs[long_id].new_token_ids
        others_tokens += sum(len(outputs[r].new_token_ids) for r in running if r in outputs)
    assert part_way >= 12  # two of three layers' steps of (nearly) every chunk
    assert others_tokens >= 2 * 20  # both advance at (nearly) every step of its prefill
    while engine.has_unfinished():
        for output in engine.step():
            long_tokens += output.new_token_ids if output.request_id == long_id else []
    assert long_tokens == engine.run(long_prompt, four).token_ids  # as alone, whole chunks
    assert _pools_full(engine)


@pytest.mark.parametrize("order", ["shortest", "arrival"])
def test_a_burst_gets_its_first_tokens_shortest_prompt_first_or_in_arrival_order(tiny_llama, order):
    """Four prompts added at once: the engine gives the shortest its first token first, and
    so on (the default); else, where asked, in arrival order. Each as alone."""
    engine = _make(tiny_llama, offload="none", prompt_order=order).engine
    prompts = _prompts([150, 30, 60, 45], seed=5)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    firsts, tokens = [], {}
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id not in firsts and output.token_ids:
                firsts.append(output.request_id)
            if output.finished:
                tokens[output.request_id] = output.token_ids
    expected = [1, 3, 2, 0] if order == "shortest" else [0, 1, 2, 3]
    assert firsts == [ids[i] for i in expected]
    assert [tokens[i] for i in ids] == [engine.run(p, GREEDY).token_ids for p in prompts]


def _placements(engine: Engine, ids: list[int]) -> list[tuple[str, dict]]:
    """(lane, placement) of each request of ``ids`` the engine still holds."""
    load = engine.load()
    return [(view.lane, view.placement) for i in ids if (view := load.request(i)) is not None]


class OffloadPace:
    """A ``lane_step`` hook by which a test steps the engine no faster than the offload
    lane's thread: :meth:`wait` takes one of its steps (waiting at most ``timeout_s``
    seconds), so on a loaded machine the engine's thread cannot finish the resident
    requests before the offload lane's thread has been scheduled at all."""

    def __init__(self, timeout_s: float = 2.0):
        import threading

        self.steps, self.timeout_s = threading.Semaphore(0), timeout_s

    def __call__(self, lane_name: str) -> None:
        if lane_name == "offload":
            self.steps.release()

    def restart(self) -> None:
        """Count the offload lane's steps from now (those of earlier runs not kept)."""
        import threading

        self.steps = threading.Semaphore(0)

    def wait(self) -> None:
        self.steps.acquire(timeout=self.timeout_s)


def test_a_prompt_that_needs_streaming_runs_in_the_offload_lane_beside_the_others(tiny_llama):
    """Two short requests decode all resident; a prompt that fits only with heads streamed
    arrives. It runs in the offload lane at once, over what the short ones leave of the
    arena (their pool resized under their pages), while they go on all resident: its first
    token comes while they still decode (the engine stepped no faster than the offload
    lane's thread), their placement never changes, and every request's tokens equal its
    own run alone."""
    from headspace.engine.hooks import EngineHooks

    pace = OffloadPace()
    engine = _make(tiny_llama, arena_kib=150, hooks=EngineHooks(lane_step=pace)).engine
    short, long_prompt = _prompts([20, 30], seed=3), _prompts([150], seed=4)[0]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    alone = [engine.run(p, params).token_ids for p in short + [long_prompt]]
    pace.restart()  # (the long one's run alone stepped the offload lane)
    ids = [engine.add_request(p, params) for p in short]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    while not all(tokens.values()):
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    ids.append(engine.add_request(long_prompt, params))
    tokens[ids[-1]], first_token_beside, resized = [], None, False
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
            if output.request_id == ids[-1] and first_token_beside is None:
                first_token_beside = not all(len(tokens[i]) == 40 for i in ids[:2])
        short_ones = _placements(engine, ids[:2])
        assert all(lane == "resident" and placement.get("stream", 0) == 0
                   for lane, placement in short_ones)  # fmt: skip
        resized |= engine.load().lane("resident").gpu_pages < 11 and bool(short_ones)
        long_one = _placements(engine, ids[2:])
        assert all(lane in ("offload", "queued") for lane, _ in long_one)
        if long_one and engine.load().lane("resident").gpu_pages < 11:
            pace.wait()
    assert first_token_beside and resized  # it did not wait for the short ones to end
    assert [tokens[i] for i in ids] == alone
    assert _pools_full(engine) and engine.load().lane("resident").gpu_pages == 11


def test_a_short_request_gets_a_token_at_every_resident_step_while_the_offload_lane_is_held(
    tiny_llama,
):
    """The offload lane's steps (its copies, its CPU jobs) never stand between two of a
    resident request's tokens: with the offload lane held at the start of its steps (a
    test's hook), the short request decodes one token every engine step to its end; let
    go, the long one finishes as it runs alone."""
    import threading

    from headspace.engine.hooks import EngineHooks

    held = threading.Event()

    def lane_step(name: str) -> None:
        if name == "offload":
            held.wait(timeout=60)

    budget = budget_for_kib(tiny_llama, 150)
    llm = LLM(str(tiny_llama), prefill_chunk=CHUNK, page_size=PAGE, gpu_memory=budget,
              prefill_step_tokens=PAGE, hooks=EngineHooks(lane_step=lane_step))  # fmt: skip
    engine = llm.engine
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    short, long_prompt = _prompts([20], seed=3)[0], _prompts([150], seed=4)[0]
    short_id = engine.add_request(short, params)
    long_id = engine.add_request(long_prompt, params)
    gaps, since, long_tokens = [], 0, []
    while engine.load().request(short_id) is not None:
        outputs = {o.request_id: o for o in engine.step()}
        since += 1
        if short_id in outputs and outputs[short_id].new_token_ids:
            gaps.append(since)
            since = 0
        assert long_id not in outputs  # held: not one step of it
    assert len(gaps) == 30 and all(gap == 1 for gap in gaps[1:])  # a token every step
    held.set()
    while engine.has_unfinished():
        for output in engine.step():
            long_tokens += output.new_token_ids if output.request_id == long_id else []
    assert long_tokens == engine.run(long_prompt, params).token_ids
    assert _pools_full(engine)


def test_the_offload_lane_waits_where_the_others_leave_it_too_little(tiny_llama):
    """Two short requests hold 14 of the 11 pages they may reach (one is swapped out at
    times): a long arrival would get less than half the rate of the whole arena beside
    them, so it waits, and a request that came after it waits too (the resident lane lets
    it go first); once one short request has ended it starts beside the other (the arena
    is split while that one runs: read from the split, not from when the offload lane's
    thread gives its first token, which is the threads' race). Every request's tokens equal
    its own run alone."""
    engine = _make(tiny_llama, arena_kib=150).engine  # 11 resident pages of 16 tokens
    short, long_prompt = _prompts([60, 60], seed=3), _prompts([150], seed=4)[0]
    later = _prompts([20], seed=9)[0]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    alone = [engine.run(p, params).token_ids for p in short + [long_prompt, later]]
    ids = [engine.add_request(p, params) for p in short]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    for output in engine.step():
        tokens[output.request_id] += output.new_token_ids
    ids += [engine.add_request(long_prompt, params), engine.add_request(later, params)]
    tokens.update({ids[2]: [], ids[3]: []})
    beside = False
    while engine.has_unfinished():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
        both_short = all(len(tokens[i]) < 40 for i in ids[:2])
        assert not (both_short and (tokens[ids[2]] or tokens[ids[3]]))
        split = engine.load().lane("resident").gpu_pages < 11
        assert not (both_short and split)
        long_view, later_view = (engine.load().request(i) for i in ids[2:])
        if later_view is not None and later_view.state != "waiting":
            assert long_view is None or long_view.lane == "offload"  # it went first
        beside |= split and any(len(tokens[i]) < 40 for i in ids[:2])
    assert beside
    assert [tokens[i] for i in ids] == alone
    assert _pools_full(engine)


def test_lanes_split_and_join_leave_no_cycle_a_frozen_heap_would_keep(tiny_llama):
    """The server freezes the heap after its warm-up (a full collection would walk it
    between two steps): a frozen object in a reference cycle is never collected, so the
    arena's splits and joins, which drop what the warm-up's layouts made, must free it all
    by reference counts. Two splits there and back with the collector off: no cycle among
    what they made or dropped, frozen or not."""
    import gc

    engine = _make(tiny_llama, arena_kib=150).engine
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    engine.run(_prompts([20], seed=3)[0], params)  # the warm-up
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        for seed in (5, 7):
            many = SamplingParams(max_new_tokens=60, ignore_eos=True)
            for prompt in _prompts([10, 12], seed=seed):
                engine.add_request(prompt, many)
            for _ in range(3):
                engine.step()
            engine.add_request(_prompts([150], seed=seed + 1)[0], params)
            split = False
            while engine.has_unfinished():
                engine.step()
                split |= engine.load().lane("resident").gpu_pages < 11
            assert split and engine.load().lane("resident").gpu_pages == 11  # there and back
        assert gc.collect() == 0  # nothing of the splits' own in a cycle
        gc.unfreeze()
        assert gc.collect() == 0  # nor of the warm-up's that they dropped
    finally:
        gc.enable()
        gc.unfreeze()


def test_step_budget_defaults_to_the_pace_of_arrivals_and_to_throughput_for_a_batch(
    tiny_llama,
):
    """Unset, ``prefill_step_tokens`` is 512 for requests added one by one and 8192 while
    ``generate`` runs a batch given at once (back to 512 after it); a piece through every
    layer (layouts without layer slices) is 8192 tokens in both; set, it is all of them
    (in whole pages)."""
    from headspace.engine.config_fields import ARRIVING_STEP_TOKENS, AT_ONCE_STEP_TOKENS

    assert (ARRIVING_STEP_TOKENS, AT_ONCE_STEP_TOKENS) == (512, 8192)
    llm = LLM(str(tiny_llama), page_size=PAGE)
    scheduler, during = llm.engine.lanes.resident.scheduler, []
    assert scheduler.step_tokens == 512
    budget = lambda *_: during.append(scheduler.step_tokens)  # noqa: E731 (as each ends)
    llm.engine.generate_batch(_prompts([20, 30]), [GREEDY] * 2, on_finish=budget)
    assert during == [8192, 8192] and scheduler.step_tokens == 512
    assert scheduler.piece_tokens == 8192
    asked = LLM(str(tiny_llama), page_size=PAGE, prefill_step_tokens=40).engine  # whole pages
    scheduler = asked.lanes.resident.scheduler
    assert scheduler.step_tokens == scheduler.piece_tokens == 32
    with pytest.raises(UserError, match="prefill_step_tokens must be a positive integer"):
        LLM(str(tiny_llama), prefill_step_tokens=0)


def test_step_outputs_add_up_to_the_final_text(tiny_llama):
    engine = _make(tiny_llama).engine
    request = engine.add_request(_prompts([40])[0], GREEDY)
    pieces, ids, final = [], [], None
    while engine.has_unfinished():
        for output in engine.step():
            assert output.request_id == request
            pieces.append(output.new_text)
            ids += output.new_token_ids
            final = output if output.finished else final
    assert final is not None and final.finish_reason == "length"
    assert "".join(pieces) == final.text and ids == final.token_ids
    assert len(ids) == GREEDY.max_new_tokens
    assert not engine.abort(request)  # already ended


def test_generate_refuses_while_added_requests_run(tiny_llama):
    llm = _make(tiny_llama)
    request = llm.engine.add_request(_prompts([20])[0], GREEDY)
    with pytest.raises(UserError, match="still running"):
        llm.generate(_prompts([10])[0], GREEDY)
    for _ in range(3):  # its tokens on their way (a step reads the one before)
        llm.engine.step()
    assert llm.engine.abort(request)  # then generate takes the reads in flight and runs
    assert llm.generate(_prompts([10])[0], GREEDY)[0].finish_reason == "length"
    assert _pools_full(llm.engine)


def test_one_step_in_flight_and_a_finished_request_returned_at_once(tiny_llama):
    """Every step reads all steps but its own (a prompt finishing beside a decode batch
    adds one read, not two); a request whose last token is launched comes back at the next
    step even while another prompt prefills in whole chunks."""
    engine = _make(tiny_llama, offload="none").engine
    short = engine.add_request(_prompts([20], seed=5)[0],
                               SamplingParams(max_new_tokens=2, ignore_eos=True))  # fmt: skip
    while not any(o.request_id == short for o in engine.step()):
        pass  # its first token
    long_request = engine.add_request(_prompts([400], seed=6)[0], GREEDY)  # 7 chunks of 64
    steps_to_final = 0
    while True:
        steps_to_final += 1
        outputs = {o.request_id: o for o in engine.step()}
        if short in outputs and outputs[short].finished:
            break
    assert steps_to_final <= 2  # not after the other prompt's 7 chunks
    arrivals = [engine.add_request(p, GREEDY) for p in _prompts([30, 40, 50], seed=7)]
    while engine.has_unfinished():
        engine.step()
        assert len(engine.lanes.resident._reads) <= 1  # the step's own read, at most
    assert long_request < arrivals[0] and _pools_full(engine)


class _MixedCounter(EagerGraphTwin):
    """The graphs' CPU twin, counting the mixed steps it replays (a test's hook)."""

    replays: list[int] = []  # the piece's rows of each

    def run_mixed(self, piece_ids, *args):
        type(self).replays.append(len(piece_ids))
        return super().run_mixed(piece_ids, *args)


def test_a_mixed_step_replays_its_graph_with_the_piece_lengths_on_the_device(tiny_llama):
    """As above, with the decode and mixed steps' graphs (their CPU twin): every piece of
    the 400-token prompt replays a mixed step's graph (one graph a decode key and piece
    bucket: its first position, length and pages are inputs, the paged piece kernel reads
    them), the others get a token at every step, and the long one's tokens equal its
    prompt's alone."""
    _MixedCounter.replays = []
    llm = _make(tiny_llama, offload="none", mixed_steps=True,
                hooks=EngineHooks(graphs=_MixedCounter))  # fmt: skip
    mixed: list[bool] = []
    others, steps, tokens, long_id = _long_arrival(llm.engine, mixed)
    assert all(mixed[:-1]) and len(mixed) == -(-400 // CHUNK) + 1  # (the last reads its token)
    # every token of its prompt through a graph's piece (a short prompt's pieces before it)
    assert sum(_MixedCounter.replays[-sum(mixed) :]) == 400
    assert llm.engine.load().lanes[0].mixed_graphs  # (the view says so)
    assert others >= 2 * (steps - 1)
    alone = _make(tiny_llama, offload="none").engine.run(_prompts([400], seed=4)[0], FOUR)
    assert tokens[long_id] == alone.token_ids
    assert _pools_full(llm.engine)


def test_a_mixed_step_runs_as_a_graph_only_where_its_graph_serves_it(tiny_llama):
    """What a mixed step's graph takes: a resident layout's piece of at most 1,024 rows, its
    sequence and the decode rows' within the one width every table is packed at (at most
    16K keys); not the blocks tuned per row count (each new piece would compile while
    serving), nor a layout with budgets (their per-entry pages attend outside the paged
    piece kernel)."""
    from headspace.engine.mixed_graphs import MOST_GRAPHED_KEYS, MOST_GRAPHED_PIECE

    def graphs(**options):
        llm = _make(tiny_llama, mixed_steps=True, hooks=EngineHooks(graphs=_MixedCounter),
                    **options)  # fmt: skip
        llm.engine.run(_prompts([40])[0], FOUR)  # (the layout and its graphs made)
        return llm.engine.lanes.resident.runner.graphs

    resident = graphs(offload="none")
    pages = resident.mixed_width  # every table packed at it: the tiny model's whole context
    assert pages == min(512 // PAGE, MOST_GRAPHED_KEYS // PAGE)
    assert resident.accepts_mixed(PAGE, 1, 1)
    assert resident.accepts_mixed(MOST_GRAPHED_PIECE, pages, pages)
    assert not resident.accepts_mixed(MOST_GRAPHED_PIECE + 1, 1, 1)
    assert not resident.accepts_mixed(PAGE, pages + 1, 1)
    assert not resident.accepts_mixed(PAGE, 1, pages + 1)  # a decode row past the width
    resident.blocks_mode = "tuned"
    assert not resident.accepts_mixed(PAGE, 1, 1)
    assert not graphs(kv_budget=0.5).accepts_mixed(PAGE, 1, 1)


class _NoMixedWidth(_MixedCounter):
    """The counting twin with no width to pack a mixed step's tables at: no mixed graph
    takes a step (a test's hook)."""

    def __init__(self, site: GraphSite, tiers, pool):
        super().__init__(dataclasses.replace(site, piece_width=0), tiers, pool)


def test_a_mixed_step_no_graph_takes_runs_as_two_forwards(tiny_llama):
    """Where the layout's decode steps are graphs but no mixed graph takes a step (here its
    sequences past the width every table is packed at), the step runs as two forwards, the
    decode step's a graph, rather than one eager forward (launch-bound on a GPU): no step
    of the 400-token prompt's prefill is mixed, and its tokens equal its prompt's alone."""
    _MixedCounter.replays = []
    llm = _make(tiny_llama, offload="none", mixed_steps=True,
                hooks=EngineHooks(graphs=_NoMixedWidth))  # fmt: skip
    llm.engine.run(_prompts([40])[0], FOUR)  # (the layout and its graphs made)
    mixed: list[bool] = []
    _, steps, tokens, long_id = _long_arrival(llm.engine, mixed)
    assert steps > 1 and not any(mixed) and not _MixedCounter.replays
    view = llm.engine.load().lanes[0]
    assert view.decode_graphs and not view.mixed_graphs  # (the decode steps: graphs)
    alone = _make(tiny_llama, offload="none").engine.run(_prompts([400], seed=4)[0], FOUR)
    assert tokens[long_id] == alone.token_ids

"""Tiers per request: requests of mixed lengths arrive at random steps and some are aborted;
those whose KV fits the arena run all resident in the resident lane whatever else runs, the
others stream heads (or attend them on the CPU) in the offload lane beside them. A
hypothesis state machine over the stepping engine, in every mode: each finished request's
greedy tokens equal its run alone, a resident request's placement stays resident while it
runs, and once idle every page of every lane is back in its pool."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import random_profile
from headspace import LLM, SamplingParams
from test_stepping import CHUNK, PAGE, budget_for_kib

LENGTHS = (12, 30, 60, 150, 190)  # with their new tokens: 2-13 pages of 16 tokens
HYBRID = {"arena_kib": 150, "offload": "hybrid", "cpu_share": 1.0, "gpu_window": 16}
MODES = {  # name: engine options (the arena: 11 resident pages of 16 tokens)
    "streamed": {"arena_kib": 150},
    "hybrid": HYBRID,
    "hybrid_sparse": {**HYBRID, "cpu_sparsity": 0.5, "cpu_query_blocks": 1},  # (approximate)
    "budgets": {"kv_budget": 0.5},  # per-entry pages: one lane
    "swap": {"num_kv_pages": 9},  # resident ones swap under 9 pages; the longest offload
    # half the entries streaming(4,16) by a profile's retrieval scores (approximate)
    "patterns": {"profile": "random", "retrieval_heads": 0.5, "sparse_pattern": "streaming(4,16)"},
    "weights_streamed": {"weights": "stream"},  # each layer's weights copied in as it runs
}
ENGINES: dict[str, LLM] = {}
ALONE: dict[tuple, list[int]] = {}  # (mode, length, new tokens) -> its greedy tokens alone


def _engine(checkpoint, mode: str, **extra) -> LLM:
    """The engine of ``mode`` over ``checkpoint``; ``extra``: more options (hooks, ...)."""
    options = dict(MODES[mode])
    kib = options.pop("arena_kib", None)
    budget = None if kib is None else budget_for_kib(checkpoint, kib)
    if options.get("profile") == "random":
        options["profile"] = _random_profile(checkpoint)
    return LLM(str(checkpoint), prefill_chunk=CHUNK, page_size=PAGE, gpu_memory=budget,
               prefill_step_tokens=PAGE, **options, **extra)  # fmt: skip


def _random_profile(checkpoint) -> str:
    """A profile of random retrieval scores for ``checkpoint``'s heads, saved beside it."""
    from headspace.model.config import load_config

    config = load_config(checkpoint)
    return random_profile(checkpoint / "random_profile.json", config.num_layers,
                          config.num_kv_heads, seed=3)  # fmt: skip


def _prompt(length: int) -> list[int]:
    return torch.randint(3, 40000, (length,), generator=torch.Generator().manual_seed(length)
                         ).tolist()  # fmt: skip


class Lanes(RuleBasedStateMachine):
    """The engine of one mode, driven step by step."""

    mode = "streamed"
    checkpoint = None

    def __init__(self):
        super().__init__()
        self.engine = ENGINES[self.mode].engine
        for _ in range(5000):  # what an example cut short left (a stuck engine fails here)
            if not self.engine.has_unfinished():
                break
            self.engine.step()
        assert not self.engine.has_unfinished(), self.engine.load()
        self.added: list[int] = []  # request ids, in order (what a draw picks from)
        self.running: dict[int, tuple[int, int]] = {}  # request id -> (length, new tokens)
        self.tokens: dict[int, list[int]] = {}
        self.aborted: set[int] = set()

    @rule(length=st.sampled_from(LENGTHS), new=st.integers(2, 12))
    def add(self, length: int, new: int) -> None:
        params = SamplingParams(max_new_tokens=new, ignore_eos=True)
        request = self.engine.add_request(_prompt(length), params)
        self.running[request], self.tokens[request] = (length, new), []
        self.added.append(request)

    @precondition(lambda self: self.added)
    @rule(data=st.data())
    def abort(self, data) -> None:
        """Any request added (the offload lane steps on its own thread: which have ended by
        now is not the draw's to know); one that has ended is not aborted."""
        request = self.added[data.draw(st.integers(0, len(self.added) - 1))]
        if self.engine.abort(request):
            self.aborted.add(request)

    @rule(steps=st.integers(1, 6))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            self._take(self.engine.step())

    def _take(self, outputs) -> None:
        for output in outputs:
            self.tokens[output.request_id] += output.new_token_ids
            if output.finished:
                self._check(output)

    def _check(self, output) -> None:
        length, new = self.running.pop(output.request_id)
        if output.request_id in self.aborted and output.finish_reason == "abort":
            return
        # (an aborted request may have ended before the abort reached it, as the offload
        # lane's can on that lane's thread: then it must be whole. In swap mode, one lane,
        # this was seen once and not reproduced: an abort there returned "length")
        assert output.finish_reason == "length"
        assert self.tokens[output.request_id] == output.token_ids
        assert output.token_ids == _alone(self.mode, length, new), (length, new)

    @invariant()
    def resident_stays_resident(self) -> None:
        """In the resident lane, and in the one lane ("main") of per-entry pages."""
        for view in self.engine.load().requests:
            if view.lane in ("resident", "main") and view.state != "waiting":
                assert set(view.placement) <= {"gpu", "stream", "hybrid"}
                assert view.placement.get("stream", 0) == view.placement.get("hybrid", 0) == 0

    def teardown(self) -> None:
        for _ in range(5000):
            if not self.engine.has_unfinished():
                break
            self._take(self.engine.step())
        assert not self.engine.has_unfinished() and not self.running
        for lane in self.engine.load().lanes:  # every page back, in every lane
            assert lane.gpu_pages_used == lane.host_pages_used == 0, lane


def _alone(mode: str, length: int, new: int) -> list[int]:
    key = (mode, length, new)
    if key not in ALONE:  # a run alone on a fresh engine of the same mode
        reference = _engine(Lanes.checkpoint, mode)
        ALONE[key] = reference.engine.run(_prompt(length),
                                          SamplingParams(max_new_tokens=new,
                                                         ignore_eos=True)).token_ids  # fmt: skip
    return ALONE[key]


@pytest.mark.parametrize("mode", list(MODES))
def test_requests_of_mixed_lengths_in_their_lanes(tiny_llama, mode):
    Lanes.checkpoint = tiny_llama
    ENGINES.setdefault(mode, _engine(tiny_llama, mode))
    machine = type(f"Lanes_{mode}", (Lanes,), {"mode": mode})
    machine.TestCase.settings = settings(max_examples=5, stateful_step_count=12, deadline=None,
                                         suppress_health_check=list(HealthCheck))  # fmt: skip
    machine.TestCase().runTest()
    engine = ENGINES[mode].engine  # (the mode in force, not only asked for: laid out by a
    # request of its own, as the draws may have laid out none, e.g. every request aborted)
    engine.run(_prompt(max(LENGTHS)), SamplingParams(max_new_tokens=2, ignore_eos=True))
    layouts = " ".join(lane.layout or "" for lane in engine.load().lanes)
    assert ("streaming(4,16)=3" in layouts) == (mode == "patterns"), layouts
    assert (engine.model.layer_source is not None) == (mode == "weights_streamed")


def test_a_long_and_a_short_request_run_in_their_own_lanes(tiny_llama):
    """The arena holds 11 pages of 16 tokens: a 20-token request runs all resident beside
    a 190-token one that streams heads; the view names each one's lane and placement while
    they run."""
    from headspace.engine.hooks import EngineHooks

    seen = set()

    def look(name: str) -> None:  # on each lane's own thread, before each of its steps
        lane = llm.engine.lanes.lane(name)
        plan = lane.runner.plan
        for request in lane.requests():
            if request.seq.started and plan is not None:  # (decoding)
                seen.add((request.seq.seq_id, name, plan.head_map.num_offloaded > 0))

    llm = _engine(tiny_llama, "streamed", hooks=EngineHooks(lane_step=look))
    engine = llm.engine
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    short, long = (engine.add_request(_prompt(n), params) for n in (20, 190))
    while engine.has_unfinished():
        engine.step()
    assert seen == {(short, "resident", False), (long, "offload", True)}
    lanes = {view.name: view for view in engine.load().lanes}
    prefilled = {name: view.prefilled_tokens for name, view in lanes.items()}
    assert prefilled == {"resident": 20, "offload": 190}  # every prompt token, in its lane
    assert lanes["offload"].steps >= 20 and lanes["resident"].steps >= 20
    # pinned host pages only where heads stream; no hybrid tier, no graphs on the CPU
    assert lanes["offload"].host_bytes > 0 == lanes["resident"].host_bytes
    assert {(v.cpu_share, v.decode_graphs) for v in lanes.values()} == {(None, False)}


def test_lanes_on_the_metrics_page(tiny_llama):
    """/metrics shows each lane's requests by state, steps and prompt tokens computed."""
    from headspace.server.metrics import Metrics

    engine = _engine(tiny_llama, "streamed").engine
    metrics = Metrics("tiny")
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    for n in (20, 190):
        engine.add_request(_prompt(n), params)
    engine.step()
    metrics.observe_load(engine.load(), 0)
    page = metrics.text().decode()
    counts = {
        line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith("headspace_lane_requests{")
    }
    resident = sum(n for labels, n in counts.items() if 'lane="resident"' in labels)
    assert resident == 1 and sum(counts.values()) == 2  # the long one: queued or offload
    assert 'steps_total{lane="resident",model_name="tiny"} 1.0' in page
    while engine.has_unfinished():
        engine.step()
    metrics.observe_load(engine.load(), 0)
    page = metrics.text().decode()
    assert 'prefill_tokens_total{lane="offload",model_name="tiny"} 190.0' in page
    assert 'prefill_tokens_total{lane="resident",model_name="tiny"} 20.0' in page


@pytest.mark.parametrize("held, count", [(150, 1), (100, 2)])
def test_a_request_aborted_while_it_waits_for_the_offload_lane_holds_back_nobody(
    tiny_llama, held, count
):
    """A request that needs the offload lane waits while the running ones leave it too
    little of the arena, and the resident lane admits nobody after it meanwhile (it goes
    first); aborted while it waits, the requests after it are admitted and finish."""
    engine = _engine(tiny_llama, "streamed").engine
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    firsts = [engine.add_request(_prompt(held), params) for _ in range(count)]
    engine.step()
    long = engine.add_request(_prompt(190), params)
    later = engine.add_request(_prompt(12), params)
    engine.step()
    states = {view.request_id: (view.lane, view.state) for view in engine.load().requests}
    assert states[long] == ("queued", "waiting") and states[later] == ("resident", "waiting")
    assert engine.abort(long)
    ended = {}
    for _ in range(500):
        ended |= {o.request_id: o.finish_reason for o in engine.step() if o.finished}
        if not engine.has_unfinished():
            break
    assert ended == {**dict.fromkeys(firsts, "length"), long: "abort", later: "length"}


def test_the_offload_lanes_cpu_attention_leaves_cores_while_the_resident_lane_runs(tiny_llama):
    """A long request's CPU attention (hybrid) runs on fewer threads while a short request
    decodes beside it (the engine's thread keeps a core), and on all of them once alone."""
    from headspace.engine.arena_split import SPARED_BESIDE
    from headspace.engine.hooks import EngineHooks

    seen = []  # (the short one ended, cores the offload lane's attention leaves, threads)
    confined = []  # (the short one ended, whether its prompt pieces would be confined)
    ended, beside_short = [], threading.Event()
    offload_steps, resident_steps = threading.Semaphore(0), threading.Semaphore(0)

    def look(name: str) -> None:  # the lanes in turn: a resident step after an offload one,
        # and while the short one runs an offload step after a resident one (a loaded
        # machine's threads would otherwise let either lane run far ahead)
        attention = llm.engine.lanes.lane("offload").runner.site.cpu_attention
        confined.append((bool(ended), llm.engine.lanes.worker.beside))
        if name == "offload" and attention is not None:
            seen.append((bool(ended), attention.spared, attention.threads))
            offload_steps.release()
            if beside_short.is_set():
                resident_steps.acquire(timeout=0.5)
        elif name == "resident" and attention is not None:
            offload_steps.acquire(timeout=0.5)
            resident_steps.release()

    options = dict(MODES["hybrid"])
    kib = options.pop("arena_kib")
    llm = LLM(str(tiny_llama), prefill_chunk=CHUNK, page_size=PAGE, prefill_step_tokens=PAGE,
              gpu_memory=budget_for_kib(tiny_llama, kib), cpu_threads=4,
              hooks=EngineHooks(lane_step=look), **options)  # fmt: skip
    engine = llm.engine
    long = engine.add_request(_prompt(190), SamplingParams(max_new_tokens=150, ignore_eos=True))
    while not any(view.generated_tokens for view in engine.load().requests):
        engine.step()  # (the long one decodes)
    offload_steps, resident_steps = threading.Semaphore(0), threading.Semaphore(0)
    beside_short.set()
    short = engine.add_request(_prompt(20), SamplingParams(max_new_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished and output.request_id == short:
                ended.append(len(seen))
                beside_short.clear()
            elif output.finished:
                assert output.request_id == long and ended, "the long one outlasts the short"
    beside = seen[: ended[0]]
    alone = seen[ended[0] + 2 :]  # (the change reaches its thread at its next command)
    assert (False, SPARED_BESIDE, 4 - SPARED_BESIDE) in beside
    assert alone and set(alone) == {(True, 0, 4)}
    # its prompt pieces' SMs follow the same signal (on a GPU: a green context's stream)
    assert (False, True) in confined and confined[-1] == (True, False)


def test_the_offload_lanes_prompt_pieces_leave_sms_beside_decoding_requests():
    """Beside decoding requests, a prompt piece of the offload lane goes to the stream
    confined to part of the SMs, in whole groups of SMs; its decode steps to their own
    stream; alone, to the stream of every SM. Where no green context can be made (here: no
    GPU), a warning says so and every SM is kept."""
    from headspace.engine import lane_worker as worker

    GREEN_SM_STEP, confined_sms = worker.GREEN_SM_STEP, worker.confined_sms
    green_stream, step_stream = worker.green_stream, worker.step_stream

    streams = ("prefill", "decode", "confined")
    assert step_stream(False, True, *streams) == "confined"
    assert step_stream(False, False, *streams) == "prefill"
    assert step_stream(True, True, *streams) == "decode"
    assert confined_sms(132, 0.85) == 112 and 112 % GREEN_SM_STEP == 0
    assert confined_sms(132, 0.01) == GREEN_SM_STEP  # (one group at least)
    assert confined_sms(132, 1.0) is None and confined_sms(8, 0.5) is None
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="keep every SM beside decoding requests"):
            assert green_stream(torch.device("cuda"), 8) is None


@pytest.mark.parametrize("mode", ["streamed", "hybrid"])
def test_a_short_request_arriving_after_a_long_one_runs_beside_it(tiny_llama, mode):
    """Requests added one by one keep a reserve of the arena in the resident lane: a short
    request that arrives while a long one decodes in the offload lane runs at once, all
    resident, and ends while the long one still runs (it does not wait for it to end; the
    offload lane held at the start of its steps meanwhile, so that its thread cannot
    finish first on a loaded machine)."""
    from headspace.engine.hooks import EngineHooks

    held = threading.Event()
    held.set()

    def lane_step(name: str) -> None:
        if name == "offload":
            held.wait(timeout=60)

    engine = _engine(tiny_llama, mode, hooks=EngineHooks(lane_step=lane_step)).engine
    long = engine.add_request(_prompt(190), SamplingParams(max_new_tokens=60, ignore_eos=True))
    while not any(view.generated_tokens for view in engine.load().requests):
        engine.step()
    held.clear()
    short = engine.add_request(_prompt(20), SamplingParams(max_new_tokens=4, ignore_eos=True))
    order, lanes = [], set()
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
        lanes |= {(v.request_id, v.lane) for v in engine.load().requests if v.state == "decoding"}
        if short in order:
            held.set()
    assert order == [short, long] and (short, "resident") in lanes


def test_a_prefix_cached_beside_a_long_request_is_still_right_once_the_arena_joins(tiny_llama):
    """A short request's prompt cached in the resident lane's smaller pool while a long one
    runs in the offload lane, the pool growing back while another request still holds
    pages: the same prompt later reuses its cached page and gets the tokens it gets alone
    (before, the page past the held ones was not moved to the larger layout)."""
    from headspace.engine.hooks import EngineHooks

    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    alone = _engine(tiny_llama, "streamed").engine.run(_prompt(30), params).token_ids
    offload_steps = threading.Semaphore(0)

    def in_turn(name: str) -> None:  # a resident step after an offload one, while it runs
        if name == "offload":
            offload_steps.release()
        elif engine.lanes.split.handed:
            offload_steps.acquire(timeout=0.5)

    kib = MODES["streamed"]["arena_kib"]
    engine = LLM(str(tiny_llama), prefill_chunk=CHUNK, page_size=PAGE, prefill_step_tokens=PAGE,
                 gpu_memory=budget_for_kib(tiny_llama, kib),
                 hooks=EngineHooks(lane_step=in_turn)).engine  # fmt: skip

    ended = {}  # request id -> its final output (one may end while waiting for another)

    def run_until(request_id: int):
        deadline = time.monotonic() + 120
        while request_id not in ended and time.monotonic() < deadline:
            ended.update((o.request_id, o) for o in engine.step() if o.finished)
        assert request_id in ended, "it did not end"
        return ended[request_id]

    holder = engine.add_request(_prompt(60), SamplingParams(max_new_tokens=60, ignore_eos=True))
    for _ in range(3):
        ended.update((o.request_id, o) for o in engine.step() if o.finished)
    long = engine.add_request(_prompt(190), SamplingParams(max_new_tokens=4, ignore_eos=True))
    for _ in range(3):  # (the long one may end in these steps on a fast offload lane)
        ended.update((o.request_id, o) for o in engine.step() if o.finished)
    assert run_until(engine.add_request(_prompt(30), params)).token_ids == alone
    run_until(long)
    again = run_until(engine.add_request(_prompt(30), params))
    assert again.num_cached_tokens > 0 and again.token_ids == alone
    assert engine.abort(holder)


def test_a_runner_keeps_the_decode_graphs_of_its_most_recent_layouts_only():
    """Each split of the arena gives the resident lane a layout of its own size; a server
    meets ever new sizes, and graphs kept for all of them would grow its memory without
    bound. The cache keeps those of the last ``kept`` layouts used."""
    from headspace.engine.runner_graphs import GraphCache

    made, freed = [], []

    class Graphs:
        def __init__(self, layout: int):
            self.layout = layout

        def release(self) -> None:
            freed.append(self.layout)

    cache = GraphCache(twin=True, kept=2)

    def get(layout: int, generation: int = 0) -> Graphs:
        return cache.get(layout, (generation,), lambda pool: made.append(layout) or Graphs(layout))

    whole = get(0)
    get(1)
    assert get(0) is whole  # the same graphs again: the most recently used now
    get(2)  # a third layout: the least recently used one's graphs are freed
    assert freed == [1] and len(cache) == 2 and get(0) is whole
    get(0, generation=1)  # the tensors they address moved: made anew, the old ones freed
    assert freed == [1, 0] and made == [0, 1, 2, 0]
    for layout in range(3, 40):
        get(layout)
    assert len(cache) == 2 and len(freed) == len(made) - 2


def test_a_stream_after_an_aborted_offloaded_request_gives_its_own_text_alone(tiny_llama):
    """A request aborted in the offload lane ends there a few steps later (on that lane's
    thread): a stream begun meanwhile yields its own text only, as when it runs alone (it
    yielded the aborted request's last tokens too)."""
    llm, params = _engine(tiny_llama, "streamed"), SamplingParams(max_new_tokens=6, ignore_eos=True)
    engine = llm.engine
    long = engine.add_request(_prompt(190), params)
    for _ in range(3):
        engine.step()
    assert engine.abort(long) and not engine.lanes.has_running()
    pieces = list(engine.stream(_prompt(12), params))
    alone = _engine(tiny_llama, "streamed").engine.run(_prompt(12), params)
    assert "".join(pieces) == alone.text and engine.stream_output.token_ids == alone.token_ids

"""The compile meter: torch.compile's frames and Triton's JIT compiles timed through the hooks
each offers, once each; the CLI's note and the server's counter read it."""

from __future__ import annotations

import time

import pytest
import torch

from headspace.cli.main import compile_notes
from headspace.model.compile_meter import CompileMeter
from headspace.server.metrics import Metrics


@pytest.fixture
def meters():
    """Meters of a test's own; each one's hooks taken out again after it (the process's
    compiles are left alone)."""
    made: list[CompileMeter] = []

    def make() -> CompileMeter:
        made.append(CompileMeter())
        return made[-1]

    yield make
    for meter in made:
        meter.uninstall()


def test_a_torch_compile_frame_is_counted_once_and_a_cached_call_not(meters):
    meter = meters()
    meter.install()
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    before = meter.count
    compiled(torch.ones(3))
    assert meter.count == before + 1 and meter.seconds > 0
    seconds = meter.seconds
    compiled(torch.ones(3))  # the same shape: no compile
    assert meter.count == before + 1 and meter.seconds == pytest.approx(seconds)


def test_a_triton_compile_is_timed_between_its_hooks_and_a_skipped_one_not(meters):
    """Triton calls its cache hook before a compile and its post-compile hook after; a hook
    already set is kept (and one that skips the compile starts no timing)."""
    knobs = pytest.importorskip("triton").knobs
    before_hook, after_hook = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    seen = []
    try:
        knobs.runtime.jit_cache_hook = lambda **kwargs: seen.append(kwargs["key"]) or False
        meter = meters()
        meter.install()
        knobs.runtime.jit_cache_hook(key="a")
        time.sleep(0.02)
        assert meter.seconds >= 0.02 and meter.count == 0  # (running: counted up to now)
        knobs.runtime.jit_post_compile_hook(key="a")
        assert meter.count == 1 and seen == ["a"]
        seconds = meter.seconds
        assert meter.seconds == seconds  # nothing running
        knobs.runtime.jit_cache_hook = lambda **kwargs: True  # a hook that skips compiles
        skipping = meters()
        skipping.install()
        assert knobs.runtime.jit_cache_hook(key="b") is True
        assert skipping.seconds == 0.0
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before_hook, after_hook


def test_nested_compiles_count_once():
    meter = CompileMeter()
    meter.start()
    meter.start()  # (Triton's kernel inside a torch.compile frame)
    meter.end()
    assert meter.count == 0
    meter.end()
    meter.end()  # (an end with no start: ignored)
    assert meter.count == 1


def test_the_cli_notes_a_request_that_compiled_and_the_server_counts_it():
    assert compile_notes(0.01) == []
    (note,) = compile_notes(2.46)
    assert note.startswith("2.5 s of this request went to compiling")
    from headspace.engine.outputs import EngineLoad

    metrics = Metrics("tiny")
    metrics.observe_load(EngineLoad(compile_seconds=3.0), 0)
    metrics.observe_load(EngineLoad(compile_seconds=4.5), 0)
    page = metrics.text().decode()
    assert 'headspace_compile_seconds_total{model_name="tiny"} 4.5' in page


def test_a_listener_hears_each_outer_compile_by_name(meters):
    """A listener gets what compiled and its seconds, once per outer compile: a
    torch.compile frame by its trigger and compile id, a Triton kernel by its name and
    specialisation; the inner compile of a nested pair is not heard apart; a listener that
    raises does not reach the compiler; taken out, the hooks time nothing more."""
    heard: list[tuple[str, float]] = []
    meter = meters()
    meter.install()
    meter.listen(lambda what, seconds: heard.append((what, seconds)))
    torch.compile(lambda x: x * 3 - 1, backend="eager")(torch.ones(2))
    ((frame, seconds),) = heard
    assert frame.startswith("torch.compile dynamo ") and "/" in frame and seconds > 0
    heard.clear()
    meter.start("Triton merge_kernel[num_warps=4](out: *bf16)")
    meter.start("an inner compile")
    meter.end()
    assert heard == []
    meter.end()
    assert [what for what, _ in heard] == ["Triton merge_kernel[num_warps=4](out: *bf16)"]
    meter.listen(lambda what, seconds: 1 / 0)
    meter.start()
    meter.end()  # (the listener's error stays here)
    assert meter.count == 3
    meter.listen(None)
    meter.uninstall()
    torch.compile(lambda x: x * 5 - 2, backend="eager")(torch.ones(2))
    assert meter.count == 3 and not meter.installed


def test_triton_hooks_name_the_kernel_they_compile_and_are_put_back(meters):
    knobs = pytest.importorskip("triton").knobs
    before_hook, after_hook = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    heard = []
    try:
        knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None
        meter = meters()
        meter.install()
        meter.listen(lambda what, seconds: heard.append(what))
        knobs.runtime.jit_cache_hook(key="k", repr="gather[num_warps=8](src: *bf16, n: i32)")
        knobs.runtime.jit_post_compile_hook(key="k")
        assert heard == ["Triton gather[num_warps=8](src: *bf16, n: i32)"]
        meter.uninstall()
        assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before_hook, after_hook


def test_a_ready_server_logs_each_compile_by_name(caplog, tiny_llama):
    """The engine loop, once ready, has its meter's compiles logged as warnings that name
    them (a GPU's; the test's meter stands in for one, started and ended by hand)."""
    import logging

    from headspace import LLM
    from headspace.server.engine_loop import EngineLoop

    meter = CompileMeter()
    loop = EngineLoop(LLM(str(tiny_llama), device="cpu").engine, Metrics("tiny"), 1, 0,
                      compile_meter=meter)  # fmt: skip
    assert not meter.listening
    try:
        loop.start(warm_up=False)
        assert loop.ready.wait(60) and loop.error is None and meter.listening
        with caplog.at_level(logging.WARNING, logger="headspace.serve"):
            meter.start("Triton decode_kernel[num_warps=4]()")
            meter.end()
    finally:
        loop.stop()
    (record,) = [r for r in caplog.records if r.name == "headspace.serve"]
    assert record.getMessage().startswith("compiled while serving: Triton decode_kernel")


def test_a_first_use_is_timed_once_by_name_and_a_capture_every_time():
    """What a shape costs the first time besides compiles: ``first_use`` tells the listener
    of its block by the name it gives (asked for only then) the first time a key is met,
    never again; ``timing`` (a CUDA graph's capture) every time; neither is counted as a
    compile."""
    heard, asked = [], []
    meter = CompileMeter()
    meter.listen(lambda what, seconds: heard.append(what))

    def name() -> str:
        asked.append(1)
        return "cuDNN attention plan: 512 query rows"

    for _ in range(3):
        with meter.first_use(("plan", 512), name):
            time.sleep(0.01)
    with meter.first_use(("plan", 768), lambda: "cuDNN attention plan: 768 query rows"):
        pass
    assert heard == ["cuDNN attention plan: 512 query rows", "cuDNN attention plan: 768 query rows"]
    assert len(asked) == 1 and meter.count == 0 and meter.seconds == 0.0
    for _ in range(2):
        with meter.timing("decode step CUDA graph: batch 8"):
            pass
    assert heard[2:] == ["decode step CUDA graph: batch 8"] * 2


def test_the_decode_graphs_capture_of_each_key_is_timed_by_name(tiny_llama):
    """Each decode-step graph the engine captures (the tests' twin, on the CPU) is told to
    the process's meter by its key: a server names one captured while users wait."""
    from graph_twin import EagerGraphTwin
    from headspace import LLM, SamplingParams
    from headspace.engine.hooks import EngineHooks
    from headspace.model.compile_meter import COMPILE_METER

    heard: list[str] = []
    llm = LLM(str(tiny_llama), hooks=EngineHooks(graphs=EagerGraphTwin), offload="none",
              kv_budget=0.5)  # fmt: skip
    COMPILE_METER.listen(lambda what, seconds: heard.append(what))
    try:
        llm.generate([[5, 6, 7, 8] * 5], SamplingParams(max_new_tokens=4, ignore_eos=True))
    finally:
        COMPILE_METER.listen(None)
    graphs = [what for what in heard if what.startswith("decode step CUDA graph: batch 1,")]
    assert graphs and len(graphs) == len(set(graphs))  # each key once

"""The compile meter: torch.compile's frames and Triton's JIT compiles timed through the hooks
each offers, once each; the CLI's note and the server's counter read it."""

from __future__ import annotations

import time

import pytest
import torch

from headspace.cli.main import compile_notes
from headspace.model.compile_meter import CompileMeter
from headspace.server.metrics import Metrics


def test_a_torch_compile_frame_is_counted_once_and_a_cached_call_not():
    meter = CompileMeter()
    meter.install()
    compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
    before = meter.count
    compiled(torch.ones(3))
    assert meter.count == before + 1 and meter.seconds > 0
    seconds = meter.seconds
    compiled(torch.ones(3))  # the same shape: no compile
    assert meter.count == before + 1 and meter.seconds == pytest.approx(seconds)


def test_a_triton_compile_is_timed_between_its_hooks_and_a_skipped_one_not():
    """Triton calls its cache hook before a compile and its post-compile hook after; a hook
    already set is kept (and one that skips the compile starts no timing)."""
    knobs = pytest.importorskip("triton").knobs
    before_hook, after_hook = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    seen = []
    try:
        knobs.runtime.jit_cache_hook = lambda **kwargs: seen.append(kwargs["key"]) or False
        meter = CompileMeter()
        meter.install()
        knobs.runtime.jit_cache_hook(key="a")
        time.sleep(0.02)
        assert meter.seconds >= 0.02 and meter.count == 0  # (running: counted up to now)
        knobs.runtime.jit_post_compile_hook(key="a")
        assert meter.count == 1 and seen == ["a"]
        seconds = meter.seconds
        assert meter.seconds == seconds  # nothing running
        knobs.runtime.jit_cache_hook = lambda **kwargs: True  # a hook that skips compiles
        skipping = CompileMeter()
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

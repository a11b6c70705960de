"""Batched generation over the page pool equals one-at-a-time generation."""

from __future__ import annotations

import pytest
import torch

from headspace import LLM, SamplingParams, UserError


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, embedded_dir):
    from conftest import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("batch-tiny")
    make_tiny_checkpoint("llama3", path, embedded_dir)
    return path


def _prompts(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40000, (n,), generator=generator).tolist() for n in lengths]


def test_batch_equals_one_at_a_time_with_continuous_batching(tiny_llama):
    prompts = _prompts([5, 40, 17, 90, 33, 64, 8])
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    # 12 pages of 16 tokens: not all 7 requests fit at once, so finished ones make room
    llm = LLM(str(tiny_llama), page_size=16, num_kv_pages=12, max_batch=4, offload="none")
    batched = llm.generate(prompts, params)
    single = [llm.engine.run(p, params).token_ids for p in prompts]
    assert [o.token_ids for o in batched] == single
    lane = llm.engine.load().lane("main")
    assert lane.gpu_pages == 12
    assert lane.gpu_pages_used == 0  # every page back once all are done


def test_shared_prefix_reuses_pages_and_gives_identical_outputs(tiny_llama):
    prefix = _prompts([100], seed=1)[0]
    first, second = prefix + [11, 12, 13], prefix + [21, 22]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    llm = LLM(str(tiny_llama), page_size=16)
    together = llm.generate([first, second], params)
    assert together[0].num_cached_tokens == 0
    assert together[1].num_cached_tokens == 96  # six full pages of the shared prefix
    alone = LLM(str(tiny_llama), page_size=16)
    assert together[1].token_ids == alone.generate(second, params)[0].token_ids
    assert together[0].token_ids == alone.engine.run(first, params).token_ids
    shared_peak = llm.engine.load().lane("resident").peak_pages
    unshared = LLM(str(tiny_llama), page_size=16)
    unshared.generate([first, _prompts([100], seed=2)[0] + [21, 22]], params)
    assert shared_peak < unshared.engine.load().lane("resident").peak_pages


def test_each_run_has_its_own_peak_of_pages(tiny_llama):
    """A run starts the lanes' peaks over, as it does the allocator's: a short request's
    peak after a long batch is its own pages, not the batch's."""
    llm = LLM(str(tiny_llama), page_size=16)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    llm.generate(_prompts([200, 180, 160], seed=3), params)
    after_batch = llm.engine.load().lane("resident").peak_pages
    llm.engine.run(_prompts([20], seed=4)[0], params)
    assert llm.engine.load().lane("resident").peak_pages == 2 < after_batch  # (24 tokens)


def test_request_that_can_never_fit_is_refused_without_a_host_tier(tiny_llama):
    llm = LLM(str(tiny_llama), page_size=16, num_kv_pages=4, offload="none")
    with pytest.raises(UserError, match=r"needs [0-9.]+ KiB of KV \(5 pages of 16 tokens\)"):
        llm.generate(_prompts([70])[0], SamplingParams(max_new_tokens=10))


def test_budget_smaller_than_the_weights_is_refused(tiny_llama):
    with pytest.raises(UserError, match="budget too small"):
        LLM(str(tiny_llama), gpu_memory="1MB").generate([1, 2, 3])


@pytest.mark.parametrize("value", ["lots", "-3GiB", "12XB"])
def test_unreadable_budget_is_refused(tiny_llama, value):
    with pytest.raises(UserError, match="memory budget"):
        LLM(str(tiny_llama), gpu_memory=value).generate([1, 2, 3])


def test_streaming_runs_on_the_pool_and_refuses_what_cannot_fit(tiny_llama):
    llm = LLM(str(tiny_llama), page_size=16, num_kv_pages=4, offload="none")
    with pytest.raises(UserError, match="allow offload"):
        list(llm.stream(_prompts([300])[0], SamplingParams(max_new_tokens=100)))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    pieces = list(llm.stream(_prompts([20])[0], params))
    assert len(llm.last_output.token_ids) == 30 and "".join(pieces) == llm.last_output.text
    lane = llm.engine.load().lane("main")
    assert lane.gpu_pages == 4 and lane.gpu_pages_used == 0  # pages back after streaming


def test_decode_graphs_call_the_attention_a_benchmark_wrapped(tiny_llama):
    from graph_twin import EagerGraphTwin
    from headspace.engine.hooks import EngineHooks
    from headspace.tiers.base import attend_tiers

    (prompt,) = _prompts([30], seed=3)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    options = {"offload": "none", "kv_budget": 0.5}  # per-entry decode (the twin's CPU path)
    twin = EngineHooks(graphs=EagerGraphTwin)  # the graphs' CPU twin
    plain = LLM(str(tiny_llama), hooks=twin, **options).generate([prompt], params)[0].token_ids
    decoded = []

    def timed(tiers, layer, q, kv):
        decoded.append(q.shape[0] != len(prompt))  # a decode step's rows (padded batch)
        return attend_tiers(tiers, layer, q, kv)

    llm = LLM(str(tiny_llama), hooks=EngineHooks(graphs=EagerGraphTwin, attention_hook=timed),
              **options)  # fmt: skip
    assert llm.generate([prompt], params)[0].token_ids == plain
    assert llm.engine.load().lanes[0].decode_graphs
    num_layers = llm.engine.model.config.num_layers
    # the twin's two warm-up steps and the 5 decode steps, every layer through the wrapper
    assert decoded.count(True) == (2 + 5) * num_layers


def test_decode_hooks_wrap_every_decode_step_in_order_and_pass_its_result_on(tiny_llama):
    """A benchmark's timers and profilers: each decode step runs through every hook in
    ``decode_hooks``, the first innermost, each seeing the step's sequences; what a hook
    returns is the step's result (here the greedy picks swapped for token 7)."""
    (prompt,) = _prompts([20], seed=9)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    from headspace.engine.hooks import EngineHooks

    calls = []

    def inner(seq_ids, step):
        calls.append(("inner", len(seq_ids)))
        logits, slots = step()
        forced = torch.full_like(logits, -1e9)
        forced[:, 7] = 0.0
        llm.engine.lanes.resident.runner.tokens[slots] = 7  # (the step's picks, on the device)
        return forced, slots

    def outer(seq_ids, step):
        calls.append(("outer", len(seq_ids)))
        return step()

    hooks = EngineHooks(decode_hooks=[inner, outer])
    llm = LLM(str(tiny_llama), offload="none", hooks=hooks)
    tokens = llm.generate([prompt], params)[0].token_ids
    assert tokens[1:] == [7] * 4  # the first comes from the prefill
    assert calls == [("outer", 1), ("inner", 1)] * 4
    hooks.decode_hooks.clear()  # (the list is shared: a hook taken out applies at once)
    assert llm.generate([prompt], params)[0].token_ids[1:] != [7] * 4


def test_decode_graphs_name_each_graph_they_capture_or_replay_to_the_attention(tiny_llama):
    """A benchmark's timer reads a replay's events by the graph that recorded them: before
    every graph step the graphs tell the attention hook (``graph_step``) which graph,
    whether they capture it first, and for how many sequences. Prompts starting to decode
    one after another grow the entry tables, so the graphs are made anew (their graphs
    freed): every replay follows its own graphs object's capture of that key."""
    from graph_twin import EagerGraphTwin
    from headspace.engine.hooks import EngineHooks
    from headspace.tiers.base import attend_tiers

    class Told:
        steps: list = []  # (graphs, key, capture) per graph step
        rows: list = []  # (sequences, the key's padded rows) per graph step

        def graph_step(self, graphs, key, capture, num_seqs):
            self.steps.append((graphs, key, capture))
            self.rows.append((num_seqs, key[0]))

        def __call__(self, tiers, layer, q, kv):
            return attend_tiers(tiers, layer, q, kv)

    told = Told()
    llm = LLM(str(tiny_llama), hooks=EngineHooks(graphs=EagerGraphTwin, attention_hook=told),
              offload="none", kv_budget=0.5)  # fmt: skip
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    outputs = llm.generate(_prompts([30, 40, 50], seed=5), params)
    assert all(len(o.token_ids) == 8 for o in outputs)
    made = list(dict.fromkeys(g for g, _, _ in told.steps))
    assert len(made) > 1  # the tables grew as prompts joined: graphs made anew
    captured = set()
    for graphs, key, capture in told.steps:
        assert capture == ((graphs, key) not in captured)  # told exactly when it captures
        captured.add((graphs, key))
    assert {key for g, key in captured if g is made[-1]} == made[-1].captured
    assert all(1 <= n <= padded for n, padded in told.rows) and (3, 4) in told.rows


def test_an_engine_with_decode_graphs_is_freed_when_dropped(tiny_llama):
    """No reference cycle holds the runner, its decode graphs or the KV plane they address
    once the engine is gone: the next engine sizes its arena from what this one freed."""
    import gc
    import weakref

    from graph_twin import EagerGraphTwin
    from headspace.engine.hooks import EngineHooks

    llm = LLM(str(tiny_llama), offload="none", kv_budget=0.5,
              hooks=EngineHooks(graphs=EagerGraphTwin))  # fmt: skip
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    llm.generate(_prompts([20], seed=4), params)
    runner = llm.engine.lanes.resident.runner
    graphs, plane = runner.graphs, runner.tiers[0].plane
    assert graphs is not None and any(e.plane is plane for e in graphs.tiers)
    dropped = [weakref.ref(x) for x in (runner, graphs, plane)]
    gc.disable()  # freed by reference counts alone
    try:
        del llm, runner, graphs, plane
        assert [ref() for ref in dropped] == [None] * 3
    finally:
        gc.enable()


def test_warm_up_takes_the_prompts_shapes_and_decodes_only_when_asked(tiny_llama):
    """The warm-up request: the short text alone without a prompt (or for one of a few
    tokens), else the prompt's prefill shapes (a full chunk and the last piece, at most two
    chunks); its decode step compiled and captured only when the request will decode."""
    from graph_twin import EagerGraphTwin
    from headspace.engine.hooks import EngineHooks
    from headspace.engine.warm_shapes import WARM_UP_DECODE_TOKENS, warm_up_request

    assert warm_up_request(0, 256, True) == (0, WARM_UP_DECODE_TOKENS)
    assert warm_up_request(12, 256, False) == (0, 1)
    assert warm_up_request(300, 256, False) == (300, 1)
    assert warm_up_request(10000, 4096, True) == (4096 + 10000 % 4096, WARM_UP_DECODE_TOKENS)
    assert warm_up_request(8192, 4096, True) == (8192, WARM_UP_DECODE_TOKENS)
    llm = LLM(str(tiny_llama), offload="none", kv_budget=0.5,
              hooks=EngineHooks(graphs=EagerGraphTwin))  # fmt: skip
    graphed = lambda: llm.engine.load().lanes[0].decode_graphs  # noqa: E731 (the resident lane)
    assert llm.engine.warm_up(40, decode=False) > 0 and not graphed()
    assert llm.engine.warm_up(40) > 0 and graphed()

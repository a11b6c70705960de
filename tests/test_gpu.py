"""GPU paths against their CPU reference twins (run on a GPU machine; CI has none)."""

from __future__ import annotations

import pytest
import torch

from gpu_models import GREEDY, arena_budget, greedy, make_engine, stepped, tiny_model
from headspace.attention import attend, reference_attention
from headspace.engine.hooks import EngineHooks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("heads,kv_heads,length", [(32, 8, 8191), (9, 3, 1000), (8, 8, 33)])
def test_triton_decode_matches_reference(heads, kv_heads, length):
    from headspace.attention.triton_decode import triton_decode_attention

    q = torch.randn(heads, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(kv_heads, length + 700, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    out, lse = triton_decode_attention(q, k, v, torch.tensor([length], device="cuda"))
    ref_out, ref_lse = reference_attention(q, k[:, :length], v[:, :length])
    assert _rel(out, ref_out) < 1e-2
    assert (lse - ref_lse).abs().max().item() < 1e-2


def test_new_block_table_widths_compile_no_decode_kernel():
    """A longer block table (a batch's next width, a long request's first decode steps)
    changes the slices' length and count: run-time values, so nothing compiles while a
    request waits. Each width's result still matches the reference."""
    from headspace.attention.triton_decode import paged_decode_attention
    from headspace.model.compile_meter import COMPILE_METER

    COMPILE_METER.install()
    page, pool = 128, 1100
    q = torch.randn(1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8, pool * page, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    compiled = None  # (the merge kernel has two blocks: of 32 slices and of 128)
    for index, width in enumerate((16, 640, 300, 450, 1000)):  # slices of 128, 640, 384,
        # 512 and 1,024 tokens; 16 to 128 of them
        table = torch.randperm(pool, device="cuda", dtype=torch.int32)[:width].view(1, width)
        length = width * page - 77
        out, lse = paged_decode_attention(q, k, v, table, torch.tensor([length], device="cuda"),
                                          page)  # fmt: skip
        torch.cuda.synchronize()
        compiled = COMPILE_METER.count if index == 1 else compiled  # (after both merges')
        slots = (table[0].long()[:, None] * page + torch.arange(page, device="cuda")).flatten()
        ref_out, ref_lse = reference_attention(q.transpose(0, 1), k[:, slots[:length]],
                                               v[:, slots[:length]])  # fmt: skip
        assert _rel(out.transpose(0, 1), ref_out) < 1e-2
        assert (lse.transpose(0, 1) - ref_lse).abs().max().item() < 1e-2
    assert COMPILE_METER.count == compiled


@pytest.mark.parametrize(
    "num_q,num_kv", [(1000, 1000), (300, 1300), (77, 77), (2500, 2500), (1500, 3600), (2048, 2048)]
)
def test_sdpa_gpu_matches_reference(num_q, num_kv):
    """cuDNN's calls padded to whole 256-row units (2500, 1500, 1000; 77 to a power of two)
    or exact (2048), the queries token-major as the model's: a square causal block's output
    keeps that layout (the caller's transpose stays free)."""
    q = torch.randn(num_q, 32, 128, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    k = torch.randn(8, num_kv, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for causal in (False, True):
        out, lse = attend(q, k, v, causal=causal)
        ref_out, ref_lse = reference_attention(q, k, v, causal=causal)
        assert _rel(out, ref_out) < 1e-2
        assert (lse - ref_lse).abs().max().item() < 2e-2
        if causal and num_q == num_kv:
            assert out.transpose(0, 1).is_contiguous()


def test_gpu_engine_matches_cpu_reference():
    prompt = torch.randint(0, 512, (700,), generator=torch.Generator().manual_seed(1))
    cpu = make_engine(tiny_model("cpu", torch.float32))
    ref_logits = cpu.logits(prompt.tolist())
    gpu = make_engine(tiny_model("cuda", torch.float32), dtype="float32")
    assert (gpu.logits(prompt.tolist()) - ref_logits).abs().max().item() < 1e-3
    assert greedy(gpu, [prompt]) == greedy(cpu, [prompt])
    bf16_logits = make_engine(tiny_model("cuda", torch.bfloat16)).logits(prompt.tolist())
    assert (bf16_logits - ref_logits).abs().max().item() <= 2e-2 * ref_logits.abs().max().item()


def test_the_gpu_budget_is_read_once_when_the_engine_is_made(monkeypatch):
    """Without a budget the engine's is its weights plus 90% of the GPU's free memory when
    it is made, read once: sizing its chunk and arena (each after the last allocation)
    reads free memory no more; ``plan`` reads the same default."""
    from headspace.engine.memory import default_gpu_budget

    model = tiny_model("cuda", torch.float32)
    weights = sum(p.nbytes for p in model.parameters())
    expected = default_gpu_budget(torch.device("cuda"), weights)
    readings, free_memory = [], torch.cuda.mem_get_info

    def reading(device=None):
        readings.append(device)
        return free_memory(device)

    monkeypatch.setattr(torch.cuda, "mem_get_info", reading)
    engine = make_engine(model, dtype="float32")
    arena = engine.lanes.arena_bytes  # (its parts sized and allocated)
    budget = engine.config.cache.gpu_memory
    assert len(readings) == 1 and isinstance(budget, int)
    assert abs(budget - expected) <= 0.01 * expected and 0 < arena < budget


def test_copies_and_captures_keep_one_stream_each_apart_from_the_others():
    """Copy and capture streams are made once a device and priority; the capture stream is
    none of the streams torch hands out at the priorities the engine's other streams use,
    however many are drawn (a capture records whatever is queued on its stream)."""
    from headspace.engine.paged_graphs import capture_stream
    from headspace.kv.transfer import shared_stream

    device = torch.device("cuda")
    assert shared_stream(device, -1) is shared_stream(torch.device("cuda", 0), -1)
    drawn = {torch.cuda.Stream(priority=p).cuda_stream for p in (0, -1, -2) for _ in range(40)}
    assert capture_stream(device).cuda_stream not in drawn


def test_two_fresh_processes_give_the_same_greedy_tokens(tmp_path):
    """Each process compiles its kernels into empty caches: kernels whose configuration
    changes their sums are chosen by rule, not timed, so greedy tokens do not depend on a
    process's timings or its cache (tune_decode aside)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).parent / "workers" / "greedy_tokens.py"
    runs = []
    for name in ("first", "second"):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / name / "inductor"),
                   HEADSPACE_CACHE=str(tmp_path / name / "headspace"),
                   TRITON_CACHE_DIR=str(tmp_path / name / "triton"))  # fmt: skip
        env.pop("TORCHINDUCTOR_DETERMINISTIC", None)
        done = subprocess.run([sys.executable, str(worker)], env=env, capture_output=True,
                              text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert len(runs[0]) > 16 and runs[0] == runs[1]


def test_graph_decode_equals_eager_decode_and_batches_equal_one_at_a_time():
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=generator) for n in (30, 300, 129, 700)]
    model = tiny_model("cuda", torch.float32)
    graphed = make_engine(model, dtype="float32")
    batched = greedy(graphed, prompts)
    # made once the first holds its arena: a default budget is 90% of the memory free when
    # an engine is made, and an engine lays out its arena at its first request
    eager = make_engine(model, dtype="float32", cuda_graph=False, compile=False)
    assert batched == [greedy(eager, [p])[0] for p in prompts]
    assert graphed.load().lanes[0].decode_graphs  # (the resident lane)


def test_penalties_and_logprobs_in_graph_steps_equal_the_eager_ones():
    """A penalised request and one asking for log probabilities beside a plain one: the
    graphed steps' tokens and log probabilities are the eager steps' (fp32)."""
    from headspace.engine.sampling import SamplingParams

    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in (40, 260, 90)]
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True),
              SamplingParams(max_new_tokens=24, ignore_eos=True, frequency_penalty=1.2,
                             repetition_penalty=1.3, min_tokens=4),
              SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=3)]  # fmt: skip
    model = tiny_model("cuda", torch.float32)
    graphed = make_engine(model, dtype="float32").generate_batch(prompts, params)
    eager = make_engine(model, dtype="float32", cuda_graph=False, compile=False)
    alone = [eager.generate_batch([p], [q])[0] for p, q in zip(prompts, params, strict=True)]
    assert [o.token_ids for o in graphed] == [o.token_ids for o in alone]
    plain = greedy(eager, [torch.tensor(prompts[1])])[0][:24]
    assert graphed[1].token_ids != plain  # (the penalties change the greedy tokens)
    got, want = graphed[2].logprobs, alone[2].logprobs
    assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want], abs=1e-3)
    assert [[i for i, _ in lp.top] for lp in got] == [[i for i, _ in lp.top] for lp in want]


NO_WAIT_CASES = {  # (the streamed case: one request, in the offload lane alone, since the
    # sync debug mode is the process's, and the lanes step on two threads)
    "graphs": {},
    "graphs, budgets": {"kv_budget": 0.25, "kv_policy": "ada_snapkv"},
    "eager, streamed heads in pieces": {
        "offload": "head",
        "cuda_graph": False,
        "arena_kib": 96,
        "lengths": (900,),
    },
}


@pytest.mark.parametrize("case", NO_WAIT_CASES)
def test_decode_steps_never_wait_for_the_gpu(case):
    """A decode step only queues work (its tables and lengths go through page-locked
    memory), so the host prepares step n + 1 while the GPU runs step n: torch's sync debug
    mode, set to raise on a blocking copy or a read of a device value (what drained the
    stream in the per-entry tables' and the streamed pieces' copies), passes every step of
    a second run (the first captured the graphs, where there are graphs)."""
    options = dict(NO_WAIT_CASES[case])
    lengths = options.pop("lengths", (900, 300))
    model = tiny_model("cuda", torch.float32, layers=8)
    if "arena_kib" in options:
        options["gpu_memory"] = arena_budget(model, options.pop("arena_kib") * 1024)
    hooks = EngineHooks()
    engine = make_engine(model, hooks, dtype="float32", **options)
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n))
               for n in lengths]  # fmt: skip
    expected = greedy(engine, prompts)
    runners = [engine.lanes.lane(lane.name).runner for lane in engine.load().lanes]
    checked = []

    def no_waits(seq_ids, step):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            checked.append(sum(len(r.graphs.captured) for r in runners if r.graphs))

    hooks.decode_hooks.append(no_waits)
    tokens, plans = stepped(engine, prompts)
    assert tokens == expected
    assert len(checked) >= 20 and set(checked) == {checked[0]}  # no step captured a graph
    if options.get("offload"):
        assert plans[0].head_map.count("stream") > 0
        assert plans[0].staging.piece_pages < engine.lanes.spec.pages_for(900 + 64)


def test_paged_paths_on_gpu_match_reference():
    from headspace.attention.paged import flex_paged_attention, physical_block_mask
    from headspace.attention.triton_decode import paged_decode_attention

    page, num_pages, seq_lens = 128, 40, [700, 129, 2000]
    pool = torch.randn(2, 8, num_pages * page, 128, device="cuda", dtype=torch.bfloat16)
    order = torch.randperm(num_pages).tolist()
    tables = torch.zeros(3, 16, dtype=torch.int32)
    for b, n in enumerate(seq_lens):
        for j in range(-(-n // page)):
            tables[b, j] = order.pop()
    tables, lens = tables.cuda(), torch.tensor(seq_lens, device="cuda")

    def dense(b):
        pos = torch.arange(seq_lens[b], device="cuda")
        slots = tables[b].long()[pos // page] * page + pos % page
        return pool[0][:, slots], pool[1][:, slots]

    q = torch.randn(3, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    out, _ = paged_decode_attention(q[:, :, 0], pool[0], pool[1], tables, lens, page)
    ones = torch.ones_like(lens)
    mask = physical_block_mask(tables, lens - 1, ones, lens, 1, num_pages * page, page)
    flex_out, _ = flex_paged_attention(q, pool[0], pool[1], mask)
    for b in range(3):
        ref, _ = reference_attention(q[b], *dense(b))
        assert _rel(out[b], ref[:, 0]) < 1e-2
        assert _rel(flex_out[b], ref) < 1e-2


@pytest.mark.parametrize("arena_kib,pieces", [(2048, False), (96, True)])
def test_streamed_heads_on_gpu_equal_resident(arena_kib, pieces):
    """Gather kernels over page-locked host pages, staging slots and the copy stream (the
    offload lane's, short requests running beside it where they fit), against the
    all-resident run; in the small arena the history is staged in pieces."""
    model = tiny_model("cuda", torch.float32, layers=8)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=generator) for n in (900, 40, 70)]
    resident = make_engine(model, dtype="float32")
    expected = [greedy(resident, [p])[0] for p in prompts]
    streamed = make_engine(model, dtype="float32", gpu_memory=arena_budget(model, arena_kib * 1024),
                       offload="head")  # fmt: skip
    tokens, plans = stepped(streamed, prompts)
    assert tokens == expected
    plan = plans[0]  # the long one first: heads stream
    host = streamed.lanes.lane("offload").runner.host
    assert plan.head_map.count("stream") > 0 and host.data.is_pinned()
    total = streamed.lanes.spec.pages_for(900 + 64)
    assert plan.staging.piece_pages < total or not pieces
    gap = streamed.logits(prompts[0].tolist()) - resident.logits(prompts[0].tolist())
    assert gap.abs().max().item() < 1e-3


@pytest.mark.parametrize("share,arena_kib", [(1.0, 2048), (0.5, 2048), (0.5, 96)])
def test_hybrid_on_gpu_equals_resident(share, arena_kib, cpu_timings):
    """CPU threads over page-locked host pages, merged on the GPU with the streamed part."""
    model = tiny_model("cuda", torch.float32, layers=8)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=generator) for n in (900, 40, 300)]
    resident = make_engine(model, dtype="float32")
    expected = [greedy(resident, [p])[0] for p in prompts]
    hybrid = make_engine(model, EngineHooks(cpu_timings=cpu_timings), dtype="float32",
                     gpu_memory=arena_budget(model, arena_kib * 1024), offload="hybrid",
                     cpu_share=share, gpu_window=128)  # fmt: skip
    tokens, plans = stepped(hybrid, prompts)
    assert tokens == expected
    jobs = [call for call in cpu_timings.calls if call.background]
    assert plans[0].offload == "hybrid" and len(jobs) > 0
    assert sum(call.tokens for call in cpu_timings.calls) > 0


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_hybrid_window_kept_on_gpu_equals_staged(share):
    """The GPU window in GPU pages (filled once by the page kernel from page-locked host
    pages, each new token appended by the decode kernel) against the window staged every
    step: the same greedy tokens in fp32, and at share 1 nothing staged after the fill."""
    model = tiny_model("cuda", torch.float32, layers=8)
    prompt = torch.randint(0, 512, (900,), generator=torch.Generator().manual_seed(5))
    options = {"dtype": "float32", "gpu_memory": arena_budget(model, 2048 * 1024),
               "offload": "hybrid", "cpu_share": share, "gpu_window": 128}  # fmt: skip
    kept = make_engine(model, **options)
    staged = make_engine(model, window_on_gpu=False, **options)
    assert greedy(kept, [prompt]) == greedy(staged, [prompt])
    lane = kept.load().lane("offload")
    counters = lane.counters
    assert lane.plan.gpu_window is not None and counters["window_fill_pages"] > 0
    assert (counters["staged_entry_pages"] == 0) == (share == 1.0)


@pytest.mark.parametrize("offload", ["none", "head", "hybrid"])
def test_flex_backend_on_gpu_equals_the_default(offload):
    """FlexAttention over the pages (compiled) against the default kernels (cuDNN prefill,
    Triton decode) through the engine, resident and with heads streamed or split with the
    CPU under a 96 KiB arena: the same greedy tokens, and logits within 1e-3."""
    model = tiny_model("cuda", torch.float32, layers=4)
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=generator) for n in (700, 130)]
    options = {"dtype": "float32"}
    if offload != "none":
        options |= {"gpu_memory": arena_budget(model, 96 * 1024), "offload": offload}
    flex = make_engine(model, attention_backend="flex", **options)
    default = make_engine(model, **options)
    tokens, plans = stepped(flex, prompts)
    assert tokens == stepped(default, prompts)[0]
    assert plans[0].offload == offload
    gap = flex.logits(prompts[0].tolist()) - default.logits(prompts[0].tolist())
    assert gap.abs().max().item() < 1e-3


def test_sparse_hybrid_on_gpu():
    """Sparse mode on the GPU: moving averages on the device, selection on the host; beta 0
    keeps every token and equals the resident run, beta 2 keeps fewer."""
    model = tiny_model("cuda", torch.float32, layers=8)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=generator) for n in (900, 300)]
    expected = [greedy(make_engine(model, dtype="float32"), [p])[0] for p in prompts]
    budget = arena_budget(model, 100 * 1024)
    exact = make_engine(model, dtype="float32", gpu_memory=budget, offload="hybrid",
                    cpu_sparsity=0.0, gpu_window=128)  # fmt: skip
    outs = exact.generate_batch([p.tolist() for p in prompts], [GREEDY] * 2)
    assert [o.token_ids for o in outs] == expected
    assert all(o.stats.cpu_kept_fraction == (1.0, 1.0, 1.0) for o in outs)
    sparse = make_engine(model, dtype="float32", gpu_memory=budget, offload="hybrid",
                     cpu_sparsity=2.0, gpu_window=128)  # fmt: skip
    out = sparse.generate_batch([prompts[0].tolist()], [GREEDY])[0]
    assert out.stats.cpu_kept_fraction[1] < 0.9


def test_swap_out_and_in_on_gpu_keeps_outputs():
    model = tiny_model("cuda", torch.float32)
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=generator) for n in (200, 150, 230, 100)]
    expected = [greedy(make_engine(model, dtype="float32"), [p])[0] for p in prompts]
    small = make_engine(model, dtype="float32", num_kv_pages=8)  # two fit, then one must go
    outs = small.generate_batch([p.tolist() for p in prompts], [GREEDY] * 4)
    assert [o.token_ids for o in outs] == expected
    assert sum(o.stats.num_swaps for o in outs) > 0


@pytest.mark.parametrize("options", [{}, {"num_kv_pages": 8}, {"offload": "head", "arena_kib": 96}])
def test_requests_arriving_and_aborted_between_graph_steps(options):
    """The stepping engine on the GPU (graphs, swaps, streamed heads): requests added at
    different steps equal each alone, a long prompt prefills in pieces while the others
    decode, and an aborted request's pages all come back."""
    model = tiny_model("cuda", torch.float32)
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist()
               for n in (200, 150, 900, 100)]  # fmt: skip
    expected = [greedy(make_engine(model, dtype="float32"), [torch.tensor(p)])[0] for p in prompts]
    arena = options.pop("arena_kib", None)
    if arena is not None:
        options["gpu_memory"] = arena_budget(model, arena * 1024)
    engine = make_engine(model, dtype="float32", prefill_step_tokens=64, **options)
    arrivals, ids, finals = {0: [0, 1], 5: [2], 9: [3]}, {}, {}
    victim = engine.add_request(prompts[0], GREEDY)
    for step in range(10_000):
        for i in arrivals.get(step, []):
            ids[engine.add_request(prompts[i], GREEDY)] = i
        if step == 20:
            assert engine.abort(victim)
        for output in engine.step():
            if output.request_id == victim:
                assert not output.finished or output.finish_reason == "abort"
            elif output.finished:
                finals[ids[output.request_id]] = output.token_ids
        if step > 9 and not engine.has_unfinished():
            break
    assert [finals[i] for i in range(4)] == expected
    assert all(lane.gpu_pages_used == lane.host_pages_used == 0 for lane in engine.load().lanes)


def test_call_ms_times_the_device_not_the_host_issuing():
    """Many tiny kernels (fewer than the launch queue holds): the host takes longer to issue
    them than the GPU to run them, and call_ms reports the GPU's part (what the cost model
    prices), well below the wall time; a call that waits for the GPU warns."""
    import time

    from headspace.eval.profile import call_ms

    x = torch.zeros(16, device="cuda")

    def tiny_kernels():
        for _ in range(500):
            x.add_(1)

    tiny_kernels()
    torch.cuda.synchronize()
    start = time.perf_counter()
    tiny_kernels()
    torch.cuda.synchronize()
    wall_ms = 1000 * (time.perf_counter() - start)
    assert 0 < call_ms(tiny_kernels, "cuda") < 0.7 * wall_ms
    with pytest.warns(UserWarning, match="waits for the GPU"):
        call_ms(lambda: (x.add_(1), x.sum().item()), "cuda")


@pytest.mark.parametrize("sparse", ["vertical_slash(200,300)", "block_sparse(3)", "streaming(4,9)"])
def test_estimating_patterns_never_waits_for_the_gpu(sparse):
    """A chunk's pattern tables are built without a device sync (the host runs ahead)."""
    from headspace.attention.patterns import estimate
    from headspace.kv.spec import Pattern

    q = torch.randn(8, 700, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 3000, 64, device="cuda", dtype=torch.bfloat16)
    patterns = [Pattern()] * 4 + [Pattern.parse(sparse)] * 4
    estimate(patterns, q, k)  # first use: allocations and kernels loaded
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        table = estimate(patterns, q, k)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert (table.vertical.sum() > 0) == ("vertical" in sparse)
    assert (table.blocks.sum() > 0) == ("block" in sparse)


def test_layer_slices_in_bf16_compiled_blocks_equal_the_whole_pass():
    """A prefill chunk run a few layers a step hands the next slice the stream and the MLP
    output apart, so its compiled blocks add them in the norm's kernel as the whole pass
    does: bit for bit equal in bf16 (an eager add at the hand-over rounded the sum before
    the norm, where the compiled kernel does not)."""
    model = tiny_model("cuda", torch.bfloat16, layers=4)
    prompt = torch.randint(0, 512, (256,), generator=torch.Generator().manual_seed(5)).cuda()
    positions = torch.arange(prompt.numel(), device="cuda")

    def attention(layer, q, kv):  # q [tokens, heads, dim], kv [2, tokens, kv_heads, dim]
        k, v = (t.transpose(0, 1).repeat_interleave(4, 0) for t in kv)
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v,
                                                               is_causal=True)  # fmt: skip
        return out.transpose(0, 1)

    with torch.inference_mode():
        whole = model(prompt, positions, attention, "static")
        hidden = None
        for first, end in ((0, 1), (1, 3), (3, 4)):
            hidden = model(prompt, positions, attention, "static", (first, end), hidden)
    assert torch.equal(hidden, whole)


def _arrival(engine, long_prompt: list[int]) -> tuple[list[int], int]:
    """Two requests decode; ``long_prompt`` arrives asking for 8 tokens: its tokens, and the
    steps that ran a piece of it beside their decode rows in one forward."""
    from headspace.engine.sampling import SamplingParams

    generator = torch.Generator().manual_seed(6)
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    running = [engine.add_request(torch.randint(0, 512, (n,), generator=generator).tolist(),
                                  params) for n in (40, 90)]  # fmt: skip
    while not all(engine.load().request(r).generated_tokens for r in running):
        engine.step()
    long_id = engine.add_request(long_prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    tokens, mixed = [], 0
    while engine.load().request(long_id) is not None:
        tokens += [t for o in engine.step() if o.request_id == long_id for t in o.new_token_ids]
        view = engine.load()  # (the resident lane where a GPU's arena is shared, else main)
        mixed += (view.lane("resident") or view.lane("main")).last_step["mixed"]
    for request_id in running:  # (the engine is then free for generate)
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return tokens, mixed


def test_mixed_graph_steps_equal_the_eager_mixed_steps():
    """A 1,000-token prompt arrives while two requests decode. With mixed steps, each of
    its pieces and the decode rows replay a captured graph (the piece's first position,
    length and pages read on the device by the paged piece kernel; fp32; pieces of a whole
    256-token chunk, the tiny model's linear layers hidden under its weights' read at the
    H100's rates): its tokens equal those of the eager mixed steps and of its prompt
    alone."""
    prompt = torch.randint(0, 512, (1000,), generator=torch.Generator().manual_seed(7)).tolist()
    model = tiny_model("cuda", torch.float32)
    options = {"dtype": "float32", "mixed_steps": True, "prefill_step_tokens": 64}
    graphed = make_engine(model, **options)
    tokens, mixed = _arrival(graphed, prompt)
    assert mixed >= 1000 // 256 and graphed.load().lanes[0].mixed_graphs
    eager = make_engine(model, cuda_graph=False, **options)
    eager_tokens, eager_mixed = _arrival(eager, prompt)
    assert eager_mixed >= 1000 // 256 and not eager.load().lanes[0].mixed_graphs
    assert tokens == eager_tokens == greedy(eager, [torch.tensor(prompt)])[0][:8]

"""Head parallelism in the engine, launched as users do (torchrun, gloo on the CPU): every
rank's logits and tokens equal the single process's, for uniform and uneven head maps and
copied heads, on tiny configs and the embedded model; and the pure arithmetic of what a rank
computes (its heads, each copy's rows and keys)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_tiny_checkpoint, random_profile
from headspace.api import LLM
from headspace.attention.entry_decode import share_cut
from headspace.engine.sampling import SamplingParams
from headspace.parallel.placement import copy_keys, copy_rows, cumulative_shares, rank_layout
from headspace.planner.head_map import HeadEntry, HeadMap
from workers.parallel_engine import batch

WORKER = Path(__file__).parent / "workers" / "parallel_engine.py"
GREEDY = {"max_new_tokens": 10, "ignore_eos": True}
SAMPLED = {"max_new_tokens": 10, "ignore_eos": True, "temperature": 0.9, "seed": 3}


def torchrun(world: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node world ARGS`` on the CPU (gloo)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={world}", *args]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def run_cases(world: int, cases: list[dict], tmp_path: Path, timeout: int = 600) -> list[dict]:
    """Each case's results from ``world`` ranks under torchrun (within ``timeout`` s)."""
    spec, out = tmp_path / f"cases{world}.json", tmp_path / f"out{world}.pt"
    spec.write_text(json.dumps(cases))
    done = torchrun(world, str(WORKER), str(spec), str(out), timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


def single(case: dict) -> tuple[torch.Tensor, list[list[int]]]:
    llm = LLM(case["model"], **{**case["options"], **case.get("single", {})})
    logits = llm.logits(case["prompt"], decode_tokens=case["decode_tokens"])
    outputs = llm.generate(batch(case), SamplingParams(**case["params"]))
    return logits, [o.token_ids for o in outputs]


# fairkv with copies priced as free: every copy that levels the ranks is made, so these tiny
# models (whose heads cost microseconds, less than a copy adds) still exercise the copies
FREE_COPIES = {"balance": "fairkv", "copy_seconds": 0.0}


def _case(model, prompt, options=None, params=GREEDY, decode_tokens=12) -> dict:
    return {"model": str(model), "prompt": prompt, "decode_tokens": decode_tokens,
            "options": {"prefill_chunk": 64, "page_size": 16, **(options or {})},
            "params": params}  # fmt: skip


def _random_profile(path: Path, num_layers: int, num_kv_heads: int) -> str:
    return random_profile(path, num_layers, num_kv_heads, seed=7)


def _check(results: list[dict], cases: list[dict], relative: bool = False) -> list[dict]:
    """Each case's ranks' logits within 1e-5 of one process's (fp32; ``relative``: of its
    largest logit), the same tokens."""
    for got, case in zip(results, cases, strict=True):
        logits, tokens = single(case)
        tolerance = 1e-5 * (logits.abs().max().item() if relative else 1.0)
        assert (got["logits"] - logits).abs().max().item() <= tolerance, case["options"]
        assert got["tokens"] == tokens, case["options"]
    return results


def _uneven(heads: list[list[int]]) -> bool:
    """Whether ranks hold different numbers of kv heads in some layer."""
    return any(len({rank[layer] for rank in heads}) > 1 for layer in range(len(heads[0])))


def test_two_ranks_equal_one_process(tiny_llama, wide_llama, prompt, tmp_path):
    """GQA 8:2 split one head a rank; 8 layers x 4 kv heads with half the heads patterned
    (uneven prefill costs: uneven maps), greedy and fairkv, resident and streamed layers;
    sampled tokens from rank 0."""
    profile = _random_profile(tmp_path / "profile.json", 8, 4)
    patterned = {
        "profile": profile,
        "retrieval_heads": 0.5,
        "max_context": 4096,
        "sparse_pattern": "vertical_slash(16,16)",
        "balance_phase": "prefill",
    }  # costs at 4K: full heads dearer at prefill (alike at decode, where both balance)
    cases = [
        _case(tiny_llama, prompt, {"balance": "uniform"}),
        _case(tiny_llama, prompt, {"balance": "uniform"}, params=SAMPLED),
        _case(wide_llama, prompt, {**patterned, "balance": "greedy", "replicas": 0}),
        _case(wide_llama, prompt, {**patterned, "balance": "fairkv"}),
        # a small pool (ranks' pages are narrower: theirs holds both prompts)
        _case(tiny_llama, prompt, {"num_kv_pages": 12, "balance": "uniform"}),
        # the chunk from each rank's budget: the smallest on every rank
        _case(wide_llama, prompt, {**patterned, "prefill_chunk": None, "gpu_memory": 61_200_000}),
        # each rank's part of each layer streamed from host memory (one process: resident)
        {**_case(wide_llama, prompt, {**patterned, "balance": "greedy", "replicas": 0,
                                      "weights": "stream"}), "single": {"weights": "gpu"}},
    ]  # fmt: skip
    results = _check(run_cases(2, cases, tmp_path), cases)
    assert results[0]["heads"] == [[1, 1, 1], [1, 1, 1]]
    assert _uneven(results[2]["heads"])  # full heads cost more than patterned ones
    assert results[-1]["streamed"] and not results[2]["streamed"]
    assert results[-1]["heads"] == results[2]["heads"]


def test_requests_arriving_between_steps_under_two_ranks(tiny_llama, prompt, tmp_path):
    """Prompts added to the stepping engine at different steps on both ranks, resident and
    streamed: each one's tokens equal its tokens alone in one process."""
    lengths, arrivals = [150, 30, 60], [4, 0, 9]
    cases = [{**_case(tiny_llama, prompt, options), "batch": lengths, "arrivals": arrivals}
             for options in ({"balance": "uniform", "prefill_step_tokens": 16},
                             {"balance": "uniform", "num_kv_pages": 10})]  # fmt: skip
    results = run_cases(2, cases, tmp_path)
    for got, case in zip(results, cases, strict=True):
        llm = LLM(case["model"], **case["options"])
        alone = [llm.engine.run(p, SamplingParams(**GREEDY)).token_ids for p in batch(case)]
        assert got["arrivals"] == alone


ARRIVING_MODES = (  # under torchrun, one lane: shared pages (stepped in pieces), swaps, budgets
    {"balance": "uniform", "prefill_step_tokens": 16},
    {"balance": "uniform", "num_kv_pages": 10},
    {"balance": "uniform", "kv_budget": 0.5},
)
ALONE_RUNS: dict[tuple, list[int]] = {}  # (mode, length) -> its greedy tokens alone


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    schedule=st.lists(
        st.tuples(
            st.sampled_from([150, 30, 60, 12]), st.integers(0, 6), st.none() | st.integers(0, 8)
        ),
        min_size=2,
        max_size=4,
    )
)
def test_requests_arriving_and_aborted_at_random_steps_under_two_ranks(
    tiny_llama, prompt, tmp_path, schedule
):
    """Hypothesis draws when each request arrives and whether (how many steps later) it is
    aborted; under two ranks (gloo), in every mode torchrun runs, each request that is not
    aborted first ends with its tokens alone in one process; no running request's placement
    changes on any rank, and once idle every lane's pages are back in its pools."""
    lengths = [length for length, _, _ in schedule]
    arrivals = [at for _, at, _ in schedule]
    aborts = [[i, at + later] for i, (_, at, later) in enumerate(schedule) if later is not None]
    cases = [{**_case(tiny_llama, prompt, options), "batch": lengths, "arrivals": arrivals,
              "aborts": aborts} for options in ARRIVING_MODES]  # fmt: skip
    results = run_cases(2, cases, tmp_path)
    for got, case, mode in zip(results, cases, range(len(ARRIVING_MODES)), strict=True):
        assert got["moved"] == [[], []], (case["options"], got["moved"])
        assert len(got["idle_pages"]) == 2 and all(got["idle_pages"]), got["idle_pages"]
        assert all(used == [0, 0] for rank in got["idle_pages"] for _, *used in rank), got
        llm = None
        for index, (tokens, prompt_ids) in enumerate(zip(got["arrivals"], batch(case),
                                                         strict=True)):  # fmt: skip
            if tokens == "abort":
                assert any(i == index for i, _ in aborts), (case["options"], index)
                continue
            key = (mode, len(prompt_ids))
            if key not in ALONE_RUNS:
                llm = llm or LLM(case["model"], **case["options"])
                ALONE_RUNS[key] = llm.engine.run(prompt_ids, SamplingParams(**GREEDY)).token_ids
            assert tokens == ALONE_RUNS[key], (case["options"], index, schedule)


def test_four_ranks_equal_one_process(tiny_llama, wide_llama, prompt, tmp_path):
    """Four ranks over 2 kv heads: every head copied (each copy a share of the chunk's rows
    at prefill and of the keys at decode, merged by log-sum-exp); over 4 kv heads, uneven."""
    profile = _random_profile(tmp_path / "profile.json", 8, 4)
    cases = [
        _case(tiny_llama, prompt, FREE_COPIES),
        _case(wide_llama, prompt, {"profile": profile, "retrieval_heads": 0.25,
                                   "sparse_pattern": "block_sparse(2)", "max_context": 4096,
                                   "balance_phase": "prefill", **FREE_COPIES}),
        # decode as the CUDA graphs run it (their CPU twin): three prompts, a padding row
        # ... and the group left as at exit: graphs released first (NCCL hangs otherwise)
        {**_case(tiny_llama, prompt, FREE_COPIES), "batch": [150, 75, 100], "graph_twin": True,
         "leave": True},
    ]  # fmt: skip
    results = _check(run_cases(4, cases, tmp_path), cases)
    left = results[2]["left"]  # every graph released while the group stood, then it went
    assert left["had_graphs"] and not left["graphs_after"] and not left["group_after"]
    assert left["group_alive_at_release"] and all(left["group_alive_at_release"])
    assert "ranks [0, 1, 2, 3]" in results[0]["summary"]
    assert "6 entries copied" in results[0]["summary"]
    assert _uneven(results[1]["heads"])
    assert results[2]["graphs"] and "6 entries copied" in results[2]["summary"]


def test_eight_ranks_equal_one_process(wide_llama, prompt, tmp_path):
    """Eight ranks over 4 kv heads (FairKV's eight-way setting): every head copied on two
    ranks. (Over 70B's grouping: test_grouped_heads_with_streaming_ones_four_ranks.)"""
    cases = [_case(wide_llama, prompt, FREE_COPIES)]
    results = _check(run_cases(8, cases, tmp_path), cases)
    assert "32 entries copied" in results[0]["summary"]
    assert all(sum(rank[layer] for rank in results[0]["heads"]) == 8 for layer in range(8))


def test_grouped_heads_with_streaming_ones_four_ranks(embedded_dir, prompt, tmp_path):
    """Over 70B's grouping (8 kv heads of 8 query heads each), half the heads streaming, on
    four ranks: the full heads' ranks are the dearer, so fairkv copies those onto the
    streaming heads' ranks (uneven maps), dense and under Ada-SnapKV. (Copies under budgets
    over the uniform map: test_budget_copies_four_ranks.)"""
    grouped = tmp_path / "gqa8"
    make_tiny_checkpoint("llama3", grouped, embedded_dir, num_hidden_layers=4,
                         num_attention_heads=64, num_key_value_heads=8)  # fmt: skip
    streaming = {"profile": _random_profile(tmp_path / "profile.json", 4, 8),
                 "retrieval_heads": 0.5, "sparse_pattern": "streaming(4,16)",
                 "max_context": 4096, **FREE_COPIES}  # fmt: skip
    cases = [
        _case(grouped, prompt, streaming),
        _case(grouped, prompt, {**streaming, "kv_budget": 0.5, "kv_policy": "ada_snapkv"}),
    ]  # fmt: skip
    results = _check(run_cases(4, cases, tmp_path), cases)
    for result in results:
        assert _uneven(result["heads"]) and "copied" in result["summary"], result["summary"]


def test_budgets_and_streaming_heads_two_ranks(tiny_llama, wide_llama, prompt, tmp_path):
    """Per-entry pages under torchrun: each rank's heads in their own pages; Ada-SnapKV's
    heads compete for the layer's budget across ranks (scores gathered); streaming heads as
    rings; a full head copied beside a rank's own streaming heads, by uneven shares; and two
    prompts that fit one rank's pool together but not the other's: the second waits on both
    (every rank agrees)."""
    profile = _random_profile(tmp_path / "profile.json", 8, 4)
    streaming = {"profile": profile, "retrieval_heads": 0.5, "sparse_pattern": "streaming(4,16)"}
    heavy = {
        **streaming,
        "retrieval_heads": 0.25,
        "kv_budget": 0.9,
        **FREE_COPIES,
        "max_context": 4096,
    }
    cases = [
        _case(tiny_llama, prompt, {"kv_budget": 0.5, "kv_policy": "snapkv", "balance": "uniform"}),
        _case(wide_llama, prompt, {"kv_budget": 0.4, "kv_policy": "ada_snapkv", "replicas": 0}),
        _case(wide_llama, prompt, {"kv_budget": 0.7, "kv_policy": "ada_snapkv", "replicas": 0}),
        # (balanced at prefill, where a ring attends fewer keys: at decode this tiny
        # model's heads cost their kernel rows alike)
        _case(wide_llama, prompt, {**streaming, "balance": "greedy", "balance_phase": "prefill",
                                   "replicas": 0}),
        _case(wide_llama, prompt, {**streaming, "kv_budget": 64, "kv_policy": "ada_snapkv",
                                   **FREE_COPIES}, params=SAMPLED),
        _case(wide_llama, prompt, heavy),
        # rank 0 holds 14 entries, rank 1 20, in 223 entry pages: beside the short prompt
        # (43 and 55 pages), the long one's 140 fit on rank 0, its 200 not on rank 1; one
        # process holds 32 entries (more pages)
        {**_case(wide_llama, prompt, {**heavy, "num_kv_pages": 6}), "batch": [75, 150],
         "single": {"num_kv_pages": 12}},
        # decode as the CUDA graphs run it (their CPU twin): three prompts, a padding row
        {**_case(wide_llama, prompt, heavy), "batch": [150, 75, 100], "graph_twin": True},
    ]  # fmt: skip
    results = _check(run_cases(2, cases, tmp_path), cases)
    assert results[0]["heads"] == [[1, 1, 1], [1, 1, 1]]
    assert _uneven(results[3]["heads"])  # rings attend fewer keys at prefill: uneven counts
    assert "2 entries copied" in results[5]["summary"]
    assert results[5]["heads"] == [[2, 2, 2, 2, 1, 2, 1, 2], [2, 2, 2, 2, 4, 2, 4, 2]]
    assert results[-1]["graphs"] and not results[5]["graphs"]
    for result in results:  # each step's tables as wide on both ranks (a CUDA graph's key)
        assert result["widths"][0] and result["widths"][0] == result["widths"][1]


def test_budget_copies_four_ranks(tiny_llama, prompt, tmp_path):
    """Every head of a GQA 8:2 model copied over four ranks under Ada-SnapKV: each copy keeps
    the head's tokens, takes its rows at prefill and its range of the kept tokens at decode
    (a ring's too), merged by log-sum-exp."""
    profile = _random_profile(tmp_path / "profile.json", 3, 2)
    cases = [
        _case(tiny_llama, prompt, {"kv_budget": 0.5, "kv_policy": "ada_snapkv", **FREE_COPIES}),
        _case(tiny_llama, prompt, {"profile": profile, "retrieval_heads": 0.5,
                                   "sparse_pattern": "streaming(4,24)", "kv_budget": 0.6,
                                   **FREE_COPIES}),
    ]  # fmt: skip
    results = _check(run_cases(4, cases, tmp_path), cases)
    assert all("6 entries copied" in r["summary"] for r in results)


def test_embedded_model_two_ranks(embedded_dir, tmp_path):
    """The real model (3 kv heads a layer) over two ranks: one head of each layer copied.
    Its logits reach 36; summing 30 layers' partial outputs in another order moves them by
    up to 8e-5 (2e-6 of the largest, with or without copies), so the bound is relative."""
    ids = LLM(embedded_dir).engine.encode("The lighthouse keeper wrote in the log that " * 12)
    cases = [_case(embedded_dir, ids, {"prefill_chunk": 128, "page_size": 32, **FREE_COPIES})]
    results = _check(run_cases(2, cases, tmp_path), cases, relative=True)
    assert "30 entries copied" in results[0]["summary"]


def test_cli_generate_under_torchrun(tiny_llama):
    """``torchrun -m headspace.cli generate`` prints the single process's text, once; a bad
    option is one line and exit code 2."""
    args = ["--model", str(tiny_llama), "--prompt", "The light at Calder Point",
            "--max-new-tokens", "12", "--no-progress"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "headspace.cli", "generate", *args], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert one.returncode == 0, one.stderr
    two = torchrun(2, "-m", "headspace.cli", "generate", *args, "--balance", "fairkv")
    assert two.returncode == 0, two.stderr[-4000:]
    assert two.stdout == one.stdout and one.stdout.strip()
    bad = torchrun(2, "-m", "headspace.cli", "generate", *args, "--replicas", "-1")
    assert bad.returncode != 0
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "replicas must be an integer >= 0" in errors[0]
    flex = torchrun(2, "-m", "headspace.cli", "generate", *args, "--attention-backend", "flex")
    errors = [line for line in flex.stderr.splitlines() if line.startswith("error:")]
    assert flex.returncode != 0 and len(errors) == 1, flex.stderr[-2000:]
    assert "flex does not run over several GPUs" in errors[0]


def _map(num_layers: int, ranks: list[list[tuple[int, ...]]]) -> HeadMap:
    entries = []
    for layer in range(num_layers):
        for head, rank in enumerate(ranks[layer]):
            shares = tuple(1 / len(rank) for _ in rank) if len(rank) > 1 else ()
            entries.append(HeadEntry(layer, head, rank=rank, shares=shares))
    return HeadMap(num_layers, len(ranks[0]), entries)


def test_rank_layout_covers_every_head_once():
    head_map = _map(2, [[(0,), (1,), (0, 1), (2,)], [(2,), (0, 1, 2), (1,), (1,)]])
    layouts = [rank_layout(head_map, rank, 3) for rank in range(3)]
    assert layouts[0].heads(0) == [0, 2] and layouts[1].heads(1) == [2, 3, 1]
    assert [lay.num_copied for lay in layouts] == [(1, 1)] * 3
    for layer in range(2):  # each head once as an own head, or once per copy
        seen = [h for lay in layouts for h in lay.heads(layer)]
        for entry in head_map.layer(layer):
            assert seen.count(entry.kv_head) == len(entry.rank)
    assert [c.index for lay in layouts for c in lay.copies[1]] == [0, 1, 2]
    assert max(lay.most_heads for lay in layouts) == 3


def _assert_tiles(cuts: list[tuple[int, int]], end: int) -> None:
    """The copies' ``[lo, hi)`` cuts cover ``0 .. end`` in order, without gap or overlap."""
    assert cuts[0][0] == 0 and cuts[-1][1] == end
    assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(cuts, cuts[1:], strict=False))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5000), st.integers(1, 600),
       st.lists(st.floats(0.05, 1.0), min_size=2, max_size=4))  # fmt: skip
def test_copy_rows_tile_the_chunk_by_causal_work(start, num_rows, weights):
    shares = tuple(w / sum(weights) for w in weights)
    cuts = [copy_rows(start, num_rows, shares, i) for i in range(len(shares))]
    _assert_tiles(cuts, num_rows)
    total = num_rows * start + num_rows * (num_rows + 1) / 2
    for (lo, hi), share in zip(cuts, shares, strict=True):  # within one row's work of share
        work = sum(start + t + 1 for t in range(lo, hi))
        assert abs(work - share * total) <= 2 * (start + num_rows) + 1


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 100_000), st.sampled_from([16, 128]),
       st.lists(st.floats(0.05, 1.0), min_size=2, max_size=4))  # fmt: skip
def test_copy_keys_tile_the_sequence_at_pages(length, page_size, weights):
    shares = tuple(w / sum(weights) for w in weights)
    cuts = [copy_keys(length, shares, i, page_size) for i in range(len(shares))]
    _assert_tiles(cuts, length)
    assert all(lo % page_size == 0 for lo, hi in cuts if hi > lo)  # empty ones: at the end
    for (lo, hi), share in zip(cuts[:-1], shares[:-1], strict=True):  # the last: the tail
        assert abs((hi - lo) - share * length) <= page_size


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 100_000), min_size=1, max_size=8), st.sampled_from([16, 128]),
       st.lists(st.floats(0.05, 1.0), min_size=2, max_size=4))  # fmt: skip
def test_share_cut_in_torch_cuts_as_the_host_does(lengths, page_size, weights):
    """The CPU twin of the decode kernel's range cut (``share_cut``, float64 torch ops):
    the same cuts as :func:`copy_keys`, every length at once (the kernel's own cut:
    ``test_triton_copy_ranges_cut_as_the_host_and_tile_every_row``)."""
    shares = tuple(w / sum(weights) for w in weights)
    for index in range(len(shares)):
        bounds = torch.tensor(cumulative_shares(shares, index), dtype=torch.float64)
        counts = torch.tensor(lengths, dtype=torch.int32)
        lo, hi = (share_cut(fraction, counts, page_size) for fraction in bounds)
        want = [copy_keys(n, shares, index, page_size) for n in lengths]
        assert list(zip(lo.tolist(), hi.tolist(), strict=True)) == want


def test_merge_of_a_row_no_copy_attends_is_zero_not_nan():
    """A CUDA graph's padding row has no key on any copy (every lse -inf): its merged part is
    0, and a real row's copies weigh by their share of the log-sum-exp."""
    from headspace.tiers.copies import merge_copies

    lse = torch.tensor([[0.5, 1.0], [-torch.inf, -torch.inf]])  # [seqs, q_per_kv] on rank 0
    theirs = torch.tensor([[0.5, 0.0], [-torch.inf, -torch.inf]])  # rank 1's
    out = torch.ones(2, 2, 3)  # [seqs, q_per_kv, dim]

    def exchange(mine: torch.Tensor) -> torch.Tensor:
        return torch.stack([mine, theirs[:, None]])

    merge_copies(lse, out, torch.tensor([0]), 1, exchange, 2, 2, torch.device("cpu"))
    assert not out.isnan().any() and (out[1] == 0).all()
    weight = torch.sigmoid(lse[0] - theirs[0])  # e^a / (e^a + e^b)
    torch.testing.assert_close(out[0], weight[:, None].expand(2, 3))


def test_merge_of_several_copies_into_a_wider_output():
    """Two copies of a rank, in columns 2 and 0 of a layer's three copied heads, scaled in
    place in their part of a wider output (own heads first): each by ``exp(lse - total)``
    over every rank's lse of its head; the own heads' part untouched."""
    from headspace.tiers.copies import merge_copies

    generator = torch.Generator().manual_seed(3)
    seqs, q_per_kv, dim, own = 2, 2, 4, 3
    out = torch.randn(seqs, (own + 2) * q_per_kv, dim, generator=generator)
    before = out.clone()
    lse = torch.randn(seqs, 2 * q_per_kv, generator=generator)  # this rank's two copies
    theirs = torch.randn(seqs, 3, q_per_kv, generator=generator)  # the other rank's table
    columns = torch.tensor([2, 0])
    split = own * q_per_kv

    def exchange(mine: torch.Tensor) -> torch.Tensor:
        return torch.stack([mine, theirs])

    merge_copies(lse[:, :], out[:, split:], columns, 3, exchange, seqs, q_per_kv,
                 torch.device("cpu"))  # fmt: skip
    assert torch.equal(out[:, :split], before[:, :split])
    for j, column in enumerate(columns.tolist()):
        mine = lse[:, j * q_per_kv : (j + 1) * q_per_kv]
        weight = torch.sigmoid(mine - theirs[:, column])  # e^a / (e^a + e^b)
        cols = slice(split + j * q_per_kv, split + (j + 1) * q_per_kv)
        torch.testing.assert_close(out[:, cols], before[:, cols] * weight[..., None])

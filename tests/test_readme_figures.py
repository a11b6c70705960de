"""Every measured figure of the README's Modes table is read from a result file that its row
names, and each named file is the newest of its series (or says why not): the two cannot
drift apart. A figure is written from the file's value with the format the README uses."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "bench" / "results"
FILE_NAME = re.compile(r"[\w.-]+_20\d\d-\d\d-\d\d(?:_[\w-]+)?\.(?:json|csv)")

# files a row names that a newer file of the same series does not replace, and why
OLDER_ON_PURPOSE = {
    "sparsity_llama3-8b_h200_2026-11-23.json": "the only 512K head-offload run",
}


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _regress(name: str, figure: str) -> float:
    return next(r["measured"] for r in _load(name)["rows"] if r["figure"] == figure)


def _settled_ms(run: dict) -> float:
    """A hybrid search run's step after the search settled (steps 24-48, as RESULTS.md)."""
    return statistics.median(run["step_ms"][24:49])


def _scenario(name: str) -> dict:
    return _load(name)["scenarios"]["a"]


def _untuned_over_tuned(name: str) -> float:
    variants = _load(name)["variants"]
    tuned, rows = variants["tuned"]["buckets"], variants["rows_top"]["buckets"]
    return max(rows[b]["step_ms"] / tuned[b]["step_ms"] for b in tuned)


def _flex(name: str, phase: str, pick) -> float:
    return pick(v[phase] for v in _load(name)["flex_paged_vs_contiguous"].values())


def _cudnn_gain(name: str, pick) -> float:
    lengths = _load(name)["lengths"].values()
    return pick(v["prefill_ms"]["flex_paged"] / v["prefill_ms"]["cudnn_gather"] for v in lengths)


def _scaling(name: str, key: str) -> float:
    scaling = _load(name)["scaling"]
    return scaling["4"]["uniform"][key] / scaling["1"]["single"][key]


def _at(name: str, path: str):
    """The value at ``path`` ("a/b/0": keys, or list indices as digits) of file ``name``."""
    value = _load(name)
    for key in path.split("/"):
        value = value[int(key)] if isinstance(value, list) else value[key]
    return value


FOUNDATION = "foundation_llama3-8b_h200_2026-12-01.json"
COMPILE = "decode_compile_llama3-8b_h100_2026-12-06.json"
PAGED = "paged_llama3-8b_h100_2026-11-21.json"
ARRIVALS = "arrivals_llama3-8b_h200_2026-11-28.json"
MIXED = "mixed_llama3-8b_h100_2026-12-07.json"
BURST = "serve_burst16_llama3-8b_h100_2026-12-07_shortest.json"
BURST_PEER = "serve_burst16_llama3-8b_h100_2026-12-07_peer.json"
OFFLOAD, REGRESS_H200 = "offload_llama3-8b_h200_2026-11-21.json", "regress_h200_2026-12-01.json"
MILLION = "million_llama3-8b_h100_2026-11-27.json"
MILLION2 = "million_approximate_llama3-8b_h100_2026-11-28.json"
HYBRID_A = "hybrid_search_llama3-8b_h100_2026-11-28.json"
HYBRID_B = "hybrid_search_llama3-8b_h100_2026-11-28_second-host.json"
HYBRID_H200 = "hybrid_search_llama3-8b_h200_2026-11-28.json"
SPARSE = "hybrid_window_sparse_h100_2026-11-27.json"
BATCH = "batch_offload_llama3-8b_h200_2026-12-01.json"
STREAM = "weight_stream_llama3-8b_h100_2026-11-24.json"
REGRESS_H100 = "regress_h100_2026-12-07.json"
OFFLOAD_BUDGETS = "sparsity_offload_llama3-8b_h200_2026-11-24.json"
SPARSITY_512K = "sparsity_llama3-8b_h200_2026-11-23.json"
PATTERNS = "sparsity_llama3-8b_h200_2026-11-24.json"
FLEX = "flex_paged_h100_2026-11-27.json"
MULTI = "multigpu_llama3-8b-ada_snapkv-sharp-b4_h100x4_2026-11-26.json"
COPIES = "multigpu_copies_qwen2.5-3b-sharp-b256-decode-kv8192-standin-{}_h200x2_2026-11-28.json"
SERVED, SYNCED = COPIES.format("served"), COPIES.format("synced")


def _hybrid(name: str, length: str, floor: bool = False) -> float:
    run = _load(name)["runs"][length]["hybrid_split"]
    return run["pcie_floor_ms"] / _settled_ms(run) if floor else _settled_ms(run)


def _burst(key: str, over: str) -> float:
    return _at(BURST, key) / _at(BURST, over)


def _mixed(key: str) -> float:
    return _scenario(MIXED)[key]


# per row (the start of its mode): the files it reads, and each figure as the README writes
# it with the path of its value in the first file, or a function giving it
# fmt: off
FIGURES = {
    "all resident": ((FOUNDATION, COMPILE), [
        ("prefill 8K {:,.0f} tok/s", "configs/no budget/prefill/8192/tok_s"),
        ("({:.2f}x transformers)", "configs/no budget/prefill/8192/ratio_vs_transformers"),
        ("32K under 24 GiB {:.2f}x", "configs/24 GiB budget/prefill/32768/ratio_vs_transformers"),
        ("decode at 8K {:.1f} tok/s", "configs/no budget/decode/8192/tok_s"),
        ("{:.2f} of the HBM roofline", "configs/no budget/decode/8192/fraction_of_hbm_roofline"),
        ("at most {:.2f}x the tuned step's time", lambda: _untuned_over_tuned(COMPILE)),
    ]),
    "paged pool": ((PAGED,), [
        ("0.5K-8K: {:.0f} tok/s", "batch_tok_s"),
        ("{:.1f}x transformers' padded batch", "batch_ratio_vs_transformers"),
        ("KV held {:.3f}x the minimum", "kv_overhead_ratio"),
    ]),
    "requests arriving": ((ARRIVALS,), [
        ("Poisson process: {:.1f} tok/s", "throughput_tok_s"),
        ("{:.2f}x the same requests given at once", "throughput_vs_offline"),
        ("p50 {:.1f} ms", "tpot_p50_ms"),
        ("p99 {:.1f} ms while a 32K+ prompt prefills", "tpot_p99_ms_during_long_prefill"),
        ("overall p99 {:.0f} ms", "tpot_p99_ms"),
        ("time to first token p99 {:.0f} s", "ttft_p99_s"),
    ]),
    "OpenAI-compatible server": ((MIXED,), [
        ("{:.2f} ms a token p50", lambda: _mixed("short_tpot_p50_ms")),
        ("({:.2f} alone)", lambda: _mixed("short_tpot_p50_ms_alone")),
        ("p99 {:.1f} ms during its prefill",
         lambda: _mixed("short_tpot_p99_ms_during_long_prefill")),
        ("({:.1f} alone)", lambda: _mixed("short_tpot_p99_ms_alone")),
        ("{:.1f} ms during its decode",
         lambda: _mixed("short_tpot_p99_ms_during_long_decode")),
        ("first token in {:.1f} s", lambda: _mixed("long_ttft_s")),
        ("({:.1f} s alone)", lambda: _mixed("long_ttft_s_alone")),
        ("decode {:.0f} ms/token", lambda: _mixed("long_decode_ms")),
        ("({:.0f} alone)", lambda: _mixed("long_decode_ms_alone")),
        ("peak {:.1f} GiB", lambda: _mixed("peak_reserved_gib")),
        ("GiB, {:d} failed", lambda: _mixed("num_failed")),
    ]),
    "a burst of requests": ((BURST, BURST_PEER), [
        ("first tokens p50 {:.2f} s", "ttft_p50_s"),
        ("({:.2f}x the prefill bound)", lambda: _burst("ttft_p50_s", "prefill_bound_s")),
        ("{:.1f} ms a token p50", "tpot_p50_ms"),
        ("({:.2f}x its HBM roofline)", lambda: _burst("tpot_p50_ms", "tpot_roofline_ms")),
        ("{:.0f} tok/s", "output_tok_s"),
        ("first tokens {:.2f}x a warm one's", lambda: _burst("fresh_ttft_p50_s", "ttft_p50_s")),
        ("ready in {:.0f} s", "ready_s"),
        ("; {:d} failed", lambda: int(_at(BURST, "num_failed"))),
        ("variant, {:.2f} s)",
         lambda: _at(BURST_PEER, "variants/--prompt-order shortest/ttft_p50_s")),
        ("first tokens p50 {:.2f} s, ", lambda: _at(BURST_PEER, "peer_ttft_p50_s")),
        ("{:.0f} ms a token, ", lambda: _at(BURST_PEER, "peer_tpot_p50_ms")),
        ("{:.0f} tok/s |", lambda: _at(BURST_PEER, "peer_output_tok_s")),
    ]),
    "head offload": ((OFFLOAD, REGRESS_H200), [
        ("{:.0f}K tokens under", lambda: _at(OFFLOAD, "max_context/head/tokens") / 1024),
        ("decode at 128K {:.0f} ms/token",
         lambda: _regress(REGRESS_H200, "offload decode 128K ms")),
        ("{:.2f}x its PCIe floor", lambda: _regress(REGRESS_H200, "offload decode 128K ms")
         / _at(OFFLOAD, "decode_pcie_floor_ms/131072")),
    ]),
    "a million tokens": ((MILLION,), [
        ("prefill {:.0f} s", "prefill_s"),
        ("(+{:.0%} over its roofline)", "prefill_overhead_vs_roofline"),
        ("{:.2f} GiB peak", "peak_reserved_gib"),
        ("decode {:.2f} s/token hybrid", lambda: _at(MILLION, "decode_ms/hybrid") / 1e3),
        ("({:.2f}x faster than its PCIe floor)",
         "steps_over_allocated_pages/hybrid/speedup_vs_pcie_floor"),
        ("{:.2f} s head offload", lambda: _at(MILLION, "decode_ms/head") / 1e3),
        ("({:.2f}x its floor)", "decode_ratio_vs_pcie_floor/head"),
    ]),
    "two million tokens": ((MILLION2,), [
        ("prefill {:.0f} s", "prefill_s"),
        ("(+{:.0%} over its roofline)", "prefill_overhead_vs_roofline"),
        ("decode {:.2f} s/token", lambda: _at(MILLION2, "decode_ms") / 1e3),
        ("({:.2f}x its PCIe floor)", "decode_ratio_vs_pcie_floor"),
        ("{:.2f} GiB peak", "peak_reserved_gib"),
        ("KV held {:.0%} of full", "kv_fraction_held"),
    ]),
    "hybrid GPU-CPU attention": ((HYBRID_A, HYBRID_B, HYBRID_H200), [
        ("at 512K {:.0f}-", lambda: _hybrid(HYBRID_B, "512K")),
        ("-{:.0f} ms/token", lambda: _hybrid(HYBRID_A, "512K")),
        ("{:.2f}-", lambda: _hybrid(HYBRID_A, "512K", floor=True)),
        ("-{:.2f}x faster than its PCIe floor", lambda: _hybrid(HYBRID_B, "512K", floor=True)),
        ("at 128K {:.0f} ms", lambda: _hybrid(HYBRID_A, "128K")),
        ("{:.0f} ms at 512K", lambda: _at(HYBRID_H200, "runs/512K/hybrid_split/decode_ms")),
        ("at 512K, {:.2f}x",
         lambda: _at(HYBRID_H200, "runs/512K/hybrid_split/speedup_vs_pcie_floor")),
    ]),
    "hybrid sparse": ((SPARSE,), [
        ("perplexity {} / ", "sparse/perplexity_change_embedded_cpu/alice29@4096"),
        ("/ {} (alice29", "sparse/perplexity_change_embedded_cpu/plrabn12@4096"),
        ("at 8K {} / ", "sparse/perplexity_change_embedded_cpu/alice29@8192"),
        ("it keeps {:.0%}", "sparse/at_128K/sparse/cpu_kept_fraction_min_median_max/1"),
        ("median step {:.0f}", "sparse/at_128K/sparse/decode_ms"),
        ("vs {:.0f} ms", "sparse/at_128K/hybrid_cpu/decode_ms"),
    ]),
    "batched offload": ((BATCH,), [
        ("({:.1f} GiB of KV)", "kv_gib"),
        ("GiB of KV): {:.1f} tok/s", "aggregate_decode_tok_s"),
        ("{:.2f}x its PCIe floor", "ratio_vs_batch_pcie_floor"),
        ("{:.1f}x transformers' offloaded cache", "speedup_vs_transformers_offload"),
        ("which ran {:d} of the 8", lambda: len(_at(BATCH, "transformers_lengths"))),
    ]),
    "streamed weights": ((STREAM,), [("at {:.0%} of resident", "prefill_vs_resident")]),
    "per-head KV budgets": ((REGRESS_H100, OFFLOAD_BUDGETS, SPARSITY_512K), [
        ("decode at 128K {:.1f} ms/token",
         lambda: _regress(REGRESS_H100, "ada_snapkv 0.25 decode 128K ms")),
        ("{:.2f}x faster than streaming everything at 128K", lambda: _at(
            OFFLOAD_BUDGETS, "runs/131072/snapkv 0.25 head-offload/decode_speedup_vs_full")),
        ("{:.2f}x at 512K", lambda: _at(
            SPARSITY_512K, "runs/524288/snapkv 0.25 head-offload/decode_speedup_vs_full")),
    ]),
    "per-head patterns": ((PATTERNS,), [
        ("prefill at 512K {:.2f}x faster", "runs/524288/streaming 0.5/prefill_speedup_vs_full"),
    ]),
    "FlexAttention": ((FLEX,), [
        ("{:.2f}-", lambda: _flex(FLEX, "prefill", min)),
        ("-{:.2f}x its contiguous time at prefill", lambda: _flex(FLEX, "prefill", max)),
        ("{:.2f}-", lambda: _flex(FLEX, "decode", min)),
        ("-{:.2f}x at decode", lambda: _flex(FLEX, "decode", max)),
        ("{:.1f}-", lambda: _cudnn_gain(FLEX, min)),
        ("-{:.1f}x faster at prefill", lambda: _cudnn_gain(FLEX, max)),
    ]),
    "several GPUs": ((MULTI,), [
        ("prefill {:.1f}x", lambda: _scaling(MULTI, "prefill_tok_s")),
        ("decode {:.1f}x one GPU", lambda: _scaling(MULTI, "decode_tok_s")),
    ]),
    "heads balanced with copies": ((SERVED, SYNCED), [
        ("decode {:,.0f} tok/s", "scaling/2/fairkv/decode_tok_s"),
        ("{:.2f}x uniform placement", "throughput_vs_uniform/fairkv/decode"),
        ("synchronised {:.2f}x", lambda: _at(SYNCED, "throughput_vs_uniform/fairkv/decode")),
        ("layer imbalance {:.2f}",
         lambda: _at(SYNCED, "imbalance_max_over_mean/uniform/decode")),
        ("→ {:.2f}", lambda: _at(SYNCED, "imbalance_max_over_mean/fairkv/decode")),
    ]),
}
# fmt: on
CASES = [
    (mode, files, text, value)
    for mode, (files, figures) in FIGURES.items()
    for text, value in figures
]


def modes_rows() -> dict[str, str]:
    """The Modes table's rows by their mode column (the whole line)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| mode |"))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows[line.split("|")[1].strip()] = line
    return rows


def _row(mode: str) -> str:
    matches = [line for name, line in modes_rows().items() if name.startswith(mode)]
    assert len(matches) == 1, f"one Modes row starts with {mode!r}"
    return matches[0]


@pytest.mark.parametrize("mode, files, text, value", CASES,
                         ids=[f"{m}: {t}" for m, _, t, _ in CASES])  # fmt: skip
def test_a_readme_figure_is_its_named_files_value(mode, files, text, value):
    row = _row(mode)
    for name in files:
        assert name in row, f"the {mode!r} row names {name}"
        assert (RESULTS / name).is_file(), f"{name} is committed"
    figure = text.format(value() if callable(value) else _at(files[0], value))
    assert figure in row, f"the {mode!r} row reads {figure!r}"


def _series(name: str) -> tuple[str, str, str]:
    """(before the date, the date, after it) of a result file's name."""
    date = re.search(r"_(20\d\d-\d\d-\d\d)", name)
    return name[: date.start(1)], date.group(1), name[date.end(1) :]


def test_every_modes_row_names_its_newest_result_files():
    """Each row names at least one committed result file, and no file of the same series
    (the same name but for its date) is newer, unless the row's file is kept on purpose;
    each row has its figures checked above."""
    committed = [p.name for p in RESULTS.iterdir() if FILE_NAME.fullmatch(p.name)]
    for mode, row in modes_rows().items():
        named = FILE_NAME.findall(row)
        assert named, f"the {mode!r} row names its result file"
        assert any(mode.startswith(m) for m in FIGURES), f"the {mode!r} row's figures"
        for name in named:
            assert name in committed, f"{name} ({mode!r}) is committed"
            before, date, after = _series(name)
            newer = [n for n in committed if _series(n)[::2] == (before, after)
                     and _series(n)[1] > date]  # fmt: skip
            assert not newer or name in OLDER_ON_PURPOSE, f"{mode!r}: {newer} replace {name}"

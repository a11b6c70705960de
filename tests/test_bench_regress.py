"""bench/regress.py's reading of the committed results and its judgement of a figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "bench"
sys.path.insert(0, str(BENCH))
from regress import K, committed, judge  # noqa: E402


def _read(name: str) -> dict:
    return json.loads((BENCH / "results" / name).read_text())


def test_the_budgeted_prefill_and_the_roofline_fraction_are_read_from_the_foundation_file():
    budgeted, name = committed("foundation", "h200", "prefill 32K 24GiB tok/s")
    assert "_h200_" in name
    assert budgeted == _read(name)["configs"]["24 GiB budget"]["prefill"][str(32 * K)]["tok_s"]
    unbudgeted, name = committed("foundation", "h200", "prefill 32K tok/s")
    assert unbudgeted == _read(name)["configs"]["no budget"]["prefill"][str(32 * K)]["tok_s"]
    assert unbudgeted != budgeted
    fraction, name = committed("foundation", "h200", "decode 8K of HBM roofline")
    assert fraction == _read(name)["decode_fraction_of_hbm_roofline"]["no budget"]
    assert 0.3 < fraction < 1


def test_a_first_format_foundation_file_holds_no_roofline_fraction(tmp_path):
    """The first foundation files keep decode tok/s by length and no fraction of the
    roofline: the fraction is not read as the tok/s (142.0 against 0.87, a false drop)."""
    old = {"prefill_tok_s": {str(8 * K): 34000.0}, "decode_tok_s": {str(8 * K): 142.0}}
    (tmp_path / "foundation_llama3-8b_h100_2026-11-21.json").write_text(json.dumps(old))
    assert committed("foundation", "h100", "decode 8K tok/s", tmp_path)[0] == 142.0
    assert committed("foundation", "h100", "decode 8K of HBM roofline", tmp_path) == (None, None)


def test_the_batched_offload_figures_are_read_from_its_file():
    tok_s, name = committed("batch_offload", "h200", "batched offload tok/s")
    assert tok_s == _read(name)["aggregate_decode_tok_s"]
    ratio, name = committed("batch_offload", "h200", "batched offload x PCIe floor")
    assert ratio == _read(name)["ratio_vs_batch_pcie_floor"]


def _result(folder: Path, name: str, tok_s: float) -> None:
    (folder / name).write_text(json.dumps({"aggregate_decode_tok_s": tok_s}))


def test_the_newest_file_of_this_gpu_holds_the_committed_figure(tmp_path):
    _result(tmp_path, "batch_offload_llama3-8b_h200_2026-11-09.json", 1.0)
    _result(tmp_path, "batch_offload_llama3-8b_h200_2026-11-10.json", 2.0)
    _result(tmp_path, "batch_offload_llama3-8b_h100_2026-11-12.json", 3.0)
    figure = "batched offload tok/s"
    newest = (2.0, "batch_offload_llama3-8b_h200_2026-11-10.json")
    assert committed("batch_offload", "h200", figure, tmp_path) == newest
    # of one date, a later run of some rows (a suffix after the date) is the newer
    _result(tmp_path, "batch_offload_llama3-8b_h200_2026-11-10_rerun.json", 4.0)
    newest = (4.0, "batch_offload_llama3-8b_h200_2026-11-10_rerun.json")
    assert committed("batch_offload", "h200", figure, tmp_path) == newest
    # no file of this GPU: another's
    assert committed("batch_offload", "b200", figure, tmp_path)[0] == 3.0


@pytest.mark.parametrize(
    ("figure", "measured", "change", "flag"),
    [  # against a committed 1.2
        ("batched offload x PCIe floor", 1.25, -0.0417, ""),  # a ratio to a floor: lower is better
        ("batched offload x PCIe floor", 1.3, -0.0833, "DROP"),
        ("batched offload x PCIe floor", 1.1, 0.0833, ""),
        ("batched offload tok/s", 1.1, -0.0833, "DROP"),  # a rate: higher is better
        ("batched offload tok/s", 1.25, 0.0417, ""),
        ("decode 32K ms", 1.1, 0.0833, ""),
    ],
)
def test_a_change_is_positive_when_better_and_a_drop_past_five_percent_is_flagged(
    figure, measured, change, flag
):
    row = judge(figure, measured, 1.2, "x_llama3-8b_h200_2026-01-01.json", "h200")
    assert row["change"] == pytest.approx(change, abs=1e-3)
    assert row["flag"] == flag


def test_a_figure_measured_on_another_gpu_kind_is_shown_but_not_flagged():
    row = judge("batched offload tok/s", 0.5, 1.0, "x_llama3-8b_h100_2026-01-01.json", "h200")
    assert row["change"] == pytest.approx(-0.5)
    assert row["flag"] == ""

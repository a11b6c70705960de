"""bench/headlines.py: every README Modes row has its benchmark there, and a row runs only
where this machine has its GPUs and host memory (else it says why)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "bench"
sys.path.insert(0, str(BENCH))
from headlines import HEADLINES, Machine, main, plan, skip_reason  # noqa: E402
from test_readme_figures import modes_rows  # noqa: E402


def test_every_modes_row_has_a_headline_whose_script_exists():
    for mode in modes_rows():
        assert any(mode.startswith(h.mode) for h in HEADLINES.values()), mode
    for name, headline in HEADLINES.items():
        script = headline.command[0]
        assert script == "-m" or (BENCH.parent / script).is_file(), name


def test_a_row_is_skipped_with_the_reason_this_machine_gives():
    none, one = Machine(gpus=0, host_gib=16), Machine(gpus=1, host_gib=128)
    assert skip_reason(HEADLINES["foundation"], none) == "needs a CUDA GPU; this machine has none"
    assert skip_reason(HEADLINES["hybrid_sparse_quality"], none) is None  # (a CPU row)
    assert skip_reason(HEADLINES["foundation"], one) is None
    assert skip_reason(HEADLINES["multigpu"], one) == "needs 4 GPUs; this machine has 1"
    assert skip_reason(HEADLINES["million"], one) == (
        "needs 240 GiB of host memory; this host has 128"
    )
    assert skip_reason(HEADLINES["mixed"], Machine(gpus=1, host_gib=125.7)) is None
    assert HEADLINES["copies_synced"].command == HEADLINES["copies"].command[:-1]
    assert all(reason is None for _, reason in plan(list(HEADLINES), Machine(8, 1024)))
    assert [n for n, _ in plan(["paged", "foundation"], one)] == ["foundation", "paged"]


def test_a_dry_run_runs_nothing_and_says_what_it_would_do(capsys):
    assert main(["--dry-run", "--rows", "foundation", "hybrid_sparse_quality"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "hybrid sparse" in lines[1]
    assert ("would run" in lines[0]) == (Machine.here().gpus > 0)
    assert "would run" in lines[1]  # (a CPU row that asks for no host memory)

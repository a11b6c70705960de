"""The multi-GPU benchmark's decode floor (bench/multigpu_report.py, bench/multigpu_batch.py):
the K/V each layer's slowest rank reads, a copy its share, and each entry's tokens at the
batch's end under budgets, patterns and stand-in counts."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from headspace.planner.head_map import HeadEntry
from headspace.planner.profile import Profile, budget_key

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from multigpu_batch import entry_tokens_at_end  # noqa: E402
from multigpu_report import layer_floor_tokens  # noqa: E402
from stand_in import KEPT_FILE  # noqa: E402


def _flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def test_each_layer_waits_for_its_slowest_rank_a_copy_reading_its_share():
    # layer 0: rank 0 reads 10, rank 1 reads 4; layer 1: a copy split 1/4 : 3/4 of a head of
    # 8 keys beside rank 1's own head of 2 -> rank 0 reads 2, rank 1 reads 6 + 2
    placement = [[0, 0, [0], []], [0, 1, [1], []], [1, 0, [0, 1], [0.25, 0.75]], [1, 1, [1], []]]
    assert layer_floor_tokens(placement, [[10, 4], [8, 2]]) == pytest.approx(10 + 8)
    # one GPU: every entry on rank 0, the layer's sum
    one_gpu = [[0, 0, [0], []], [0, 1, [0], []]]
    assert layer_floor_tokens(one_gpu, [[10, 4]]) == pytest.approx(14)


def _entries(patterns: list[list[str]]) -> list[HeadEntry]:
    return [HeadEntry(layer, kv_head, pattern=p)
            for layer, row in enumerate(patterns) for kv_head, p in enumerate(row)]  # fmt: skip


def _profile(tmp_path: Path, key: str, shares: list[list[float]]) -> str:
    profile = Profile("test", len(shares), len(shares[0]), [[1.0] * len(shares[0])] * len(shares))
    profile.budget_shares[key] = shares
    path = tmp_path / "profile.json"
    profile.save(path)
    return str(path)


@pytest.mark.parametrize("value", [0.25, 1024])
def test_a_budgeted_entry_keeps_its_window_and_its_share_of_the_rest(tmp_path, value):
    # a fraction of the prompt or a token count: the window (32) always, the share of what
    # the policy selects beyond it, then the decoded tokens after the first
    shares = [[1.8, 0.2], [1.0, 1.0]]
    profile = _profile(tmp_path, budget_key("ada_snapkv", value), shares)
    args = SimpleNamespace(context=8192 + 101, decode=101, stand_in=False, batch=4)
    options = {"kv_budget": value, "kv_policy": "ada_snapkv"}
    kept = entry_tokens_at_end(args, _entries([["full"] * 2] * 2), options, profile)
    selectable = (2048 if value == 0.25 else 1024) - 32
    assert _flat(kept) == pytest.approx([32 + 1.8 * selectable + 100, 32 + 0.2 * selectable + 100,
                                         32 + selectable + 100, 32 + selectable + 100])  # fmt: skip


def test_a_streaming_entry_holds_its_ring_and_the_others_their_counts(tmp_path):
    # stand-in counts of three measured prompts, cycled over a batch of four (0, 1, 2, 0)
    counts = [[[100, 200]], [[300, 400]], [[500, 600]]]
    (tmp_path / KEPT_FILE).write_text(json.dumps(counts))
    args = SimpleNamespace(context=4096 + 11, decode=11, stand_in=True, batch=4)
    entries = _entries([["full", "streaming(4,1024)"]])
    kept = entry_tokens_at_end(args, entries, {}, str(tmp_path / "profile.json"))
    assert _flat(kept) == pytest.approx([(100 + 300 + 500 + 100) / 4 + 10, 4 + 1024])


def test_without_a_budget_every_entry_holds_the_whole_prompt(tmp_path):
    args = SimpleNamespace(context=5000, decode=50, stand_in=False, batch=2)
    kept = entry_tokens_at_end(args, _entries([["full", "full"]]), {}, str(tmp_path / "p.json"))
    assert kept == [[4950 + 49, 4950 + 49]]


def test_a_long_prompts_decode_floor_is_its_offloaded_kv_over_pcie():
    """bench/long_prompt.py's floor: each offloaded entry's K and V (bf16, head_dim 128) of
    every token, once a step, at the measured copy rate."""
    from long_prompt import floor_ms

    assert floor_ms(1, 1024, 1e9) == pytest.approx(1e3 * 2 * 1024 * 128 * 2 / 1e9)
    assert floor_ms(190, 130_048, 52e9) == pytest.approx(190 * floor_ms(1, 130_048, 52e9))

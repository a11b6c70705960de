"""Head profiles: retrieval scores measured on the embedded model, patterns given to the head
map by score, the profile file and the commands that write and read it."""

from __future__ import annotations

import json

import pytest
import torch

from headspace.cli.main import main
from headspace.errors import UserError
from headspace.planner.head_map import HeadMap
from headspace.planner.profile import Profile, with_patterns


def test_the_highest_scores_keep_full_attention():
    scores = [[0.1, 0.9], [0.5, 0.0], [0.3, 0.7]]
    head_map = with_patterns(HeadMap.all_gpu(3, 2), scores, 0.5, "streaming(4,64)")
    full = {(e.layer, e.kv_head) for e in head_map.entries if e.pattern == "full"}
    assert full == {(0, 1), (2, 1), (1, 0)}
    assert head_map.count("gpu") == 6 and "streaming(4,64)=3" in head_map.summary()
    assert all(e.pattern == "full" for e in with_patterns(head_map, scores, 1.0, "x").entries)
    none = with_patterns(HeadMap.all_gpu(3, 2), scores, 0.0, "streaming(4,64)")
    assert {e.pattern for e in none.entries} == {"streaming(4,64)"}
    assert "g " in none.grid() and "G " not in none.grid()
    with pytest.raises(UserError, match="share"):
        with_patterns(head_map, scores, 1.5, "streaming(4,64)")


def test_profile_files_are_checked(tmp_path):
    profile = Profile("m", 2, 2, [[0.1, 0.2], [0.3, 0.4]], pattern_ms={"full": {"2048": 1.0}})
    path = tmp_path / "p.json"
    profile.save(path)
    assert Profile.load(path) == profile
    profile.check(2, 2)
    with pytest.raises(UserError, match="2 layers x 2 kv heads, not 3 x 2"):
        profile.check(3, 2)
    (tmp_path / "bad.json").write_text(json.dumps({**json.loads(path.read_text()),
                                                   "retrieval": [[0.1], [0.2, 0.3]]}))  # fmt: skip
    with pytest.raises(UserError, match="every"):
        Profile.load(tmp_path / "bad.json")
    with pytest.raises(UserError, match="cannot read"):
        Profile.load(tmp_path / "missing.json")


def test_pattern_costs_time_a_layers_heads_and_divide_between_them(monkeypatch):
    """One call with every kv head of a layer (its query heads beside), charged to each kv
    head in equal parts: a call's fixed work is not charged whole to one head."""
    import headspace.eval.profile as profile_module

    shapes = []
    monkeypatch.setattr(profile_module, "sparse_prefill_attention",
                        lambda q, k, v, table: shapes.append((q.shape, k.shape)))  # fmt: skip
    monkeypatch.setattr(profile_module, "call_ms", lambda fn, device: (fn(), 12.0)[1])
    costs = profile_module.pattern_costs(4, 16, [512, 64], 128, "cpu", ["streaming(4,32)"],
                                         repeat=3, num_kv_heads=8)  # fmt: skip
    assert costs == {"streaming(4,32)": {"512": 1.5, "64": 1.5}}
    assert shapes[0] == ((32, 128, 16), (8, 512, 16)) and shapes[-1] == ((32, 64, 16), (8, 64, 16))
    assert len(shapes) == 2 * (1 + 3)  # a call that compiles, then the timed ones


def test_profile_and_plan_from_the_command_line(tmp_path, capsys, embedded_dir):
    """The embedded model has a few retrieval heads (scores far above the median); plan
    keeps them full and makes the others sparse."""
    out = tmp_path / "smol.json"
    code = main(["profile", "--lengths", "1k", "--depths", "30,70", "--contexts", "1k",
                 "--chunk", "256", "--output", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0 and out.exists() and out.with_suffix(".png").exists()
    profile = Profile.load(out)
    scores = sorted(x for row in profile.retrieval for x in row)
    assert scores[-1] > 0.3 and scores[len(scores) // 2] < 0.05  # few heads retrieve
    assert len(profile.cases) == 2 and set(profile.pattern_ms) >= {"full", "streaming(4,1024)"}
    shares = profile.budget_shares["ada_snapkv 0.25"]  # Ada-SnapKV's uneven heads, measured
    assert len(shares) == 30 and all(len(row) == 3 for row in shares)
    assert all(abs(sum(row) / 3 - 1) < 1e-3 for row in shares)
    assert max(max(row) for row in shares) > 1.3 and "budget shares (ada_snapkv 0.25" in text
    assert "retrieval scores of 90" in text and "block_sparse(8)" in text
    code = main(["plan", "--context", "4K", "--gpu-memory", "2GiB", "--profile", str(out),
                 "--retrieval-heads", "0.1",
                 "--sparse-pattern", "vertical_slash(64,128)"])  # fmt: skip
    plan = capsys.readouterr().out
    assert code == 0 and "vertical_slash(64,128)=81, full=9" in plan
    best = max(((x, i) for i, row in enumerate(profile.retrieval) for x in row))[1]
    assert "G " in [line for line in plan.splitlines() if line.startswith(f"layer {best:>3}")][0]
    code = main(["plan", "--context", "4K", "--gpu-memory", "2GiB", "--profile", str(out),
                 "--sparse-pattern", "dense(3)"])  # fmt: skip
    assert code == 2 and "sparse-pattern" in capsys.readouterr().err


def _random_model(num_layers: int, num_kv_heads: int):
    """A lean Llama of 8 query heads of 16 dims over a vocabulary of 97, seeded."""
    from headspace.model.config import config_from_dict
    from headspace.model.llama import LlamaModel

    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 64,
              "intermediate_size": 90, "num_hidden_layers": num_layers,
              "num_attention_heads": 8, "num_key_value_heads": num_kv_heads,
              "head_dim": 16}  # fmt: skip
    torch.manual_seed(0)
    return LlamaModel(config_from_dict(config)).eval()


def test_budget_shares_are_multiples_of_an_even_share():
    from headspace.budgets import KVBudget
    from headspace.eval.profile import budget_shares

    model = _random_model(num_layers=3, num_kv_heads=4).float()
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.3)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (200, 260)]
    shares = budget_shares(model, prompts, KVBudget(0.25, "ada_snapkv", window=16))
    assert shares.shape == (3, 4) and (shares >= 0).all()
    # a layer's heads share its total: their mean is one even share, their spread is not 0
    torch.testing.assert_close(shares.mean(1), torch.ones(3))
    assert shares.std() > 0.05
    even = budget_shares(model, prompts, KVBudget(0.25, "snapkv", window=16))
    assert torch.equal(even, torch.ones(3, 4))
    everything = budget_shares(model, prompts, KVBudget(1.0, "ada_snapkv"))
    assert torch.equal(everything, torch.ones(3, 4))  # the budget keeps every token
    # recorded in chunks (a long prompt on a small GPU), the queries of the window span two
    # chunks: the same shares as one forward
    chunked = budget_shares(model, prompts, KVBudget(0.25, "ada_snapkv", window=16), chunk=37)
    torch.testing.assert_close(chunked, shares)


def test_recording_in_chunks_equals_one_forward():
    from headspace.eval.profile import _record

    model = _random_model(num_layers=2, num_kv_heads=2).double()
    ids = torch.randint(0, 97, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    whole, chunked = _record(model, ids, 20, chunk=150), _record(model, ids, 20, chunk=70)
    for layer in range(2):
        assert chunked.keys[layer].shape == (2, 150, 16)
        assert chunked.queries[layer].shape == (8, 20, 16)  # 20 rows over chunks 2 and 3
        torch.testing.assert_close(chunked.keys[layer], whole.keys[layer])
        torch.testing.assert_close(chunked.weights(layer), whole.weights(layer))


def test_measured_shares_scale_each_budgeted_entry():
    from headspace.planner.head_map import HeadEntry, HeadMap
    from headspace.planner.profile import with_budget_shares

    head_map = HeadMap(1, 4, [HeadEntry(0, 0, budget=100), HeadEntry(0, 1, budget=100),
                              HeadEntry(0, 2), HeadEntry(0, 3, pattern="streaming(4,60)",
                                                         budget=64)])  # fmt: skip
    scaled = with_budget_shares(head_map, [[2.5, 0.004, 1.0, 3.0]])
    # at least one token kept; a streaming entry keeps its sink and window
    assert [e.budget for e in scaled.entries] == [250, 1, None, 64]

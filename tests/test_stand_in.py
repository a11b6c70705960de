"""A benchmark's stand-in prompts (``EngineHooks.prompt_stand_in``): nothing computed, each
entry kept at the count given where a KV budget picks (a rank's entries, copies included),
every other entry the whole prompt, decode from token 0 in every tier; and the counts a
benchmark gives them (``eval.profile.kept_counts``) are what the engine keeps."""

from __future__ import annotations

import pytest
import torch

from conftest import plan_of
from headspace import SamplingParams
from headspace.engine.hooks import EngineHooks
from headspace.eval.profile import kept_counts
from headspace.model.config import load_config
from headspace.planner.profile import Profile
from test_offload import _prompts, make
from test_parallel_engine import FREE_COPIES, _case, _random_profile, run_cases

RING = 20  # streaming(4,16): a ring of sink 4 and window 16


def _lengths_per_step(llm, prompt: list[int], steps: int) -> tuple[list[list[int]], list[int]]:
    """Each step's entry lengths of ``prompt``'s sequence once compressed, and its tokens."""
    engine = llm.engine
    request = engine.add_request(prompt, SamplingParams(max_new_tokens=steps, ignore_eos=True))
    entries, lengths, tokens = engine.lanes.resident.scheduler.blocks.entries, [], []
    while engine.has_unfinished():
        for output in engine.step():
            tokens = output.token_ids
        if request in entries and entries[request].compressed:
            lengths.append(list(entries[request].lengths))
    return lengths, tokens


@pytest.mark.parametrize("budget,streaming", [(0.5, False), (0.5, True), (None, True)])
def test_a_stand_in_prompt_keeps_the_given_counts(tiny_llama, tmp_path, budget, streaming):
    """Each entry holds the count given for its (layer, kv head) where the budget picks (the
    whole prompt without a budget; a streaming head its ring), one token more a decode
    step; the first token is token 0 (zero hidden states: the prompt was not run)."""
    cfg = load_config(tiny_llama)
    generator = torch.Generator().manual_seed(11)
    prompt = _prompts([150], seed=6)[0]
    kept = torch.randint(1, 151, (cfg.num_layers, cfg.num_kv_heads), generator=generator)
    options = {"kv_budget": budget, "kv_policy": "ada_snapkv"} if budget else {}
    if streaming:  # half the heads streaming(4,16)
        scores = torch.rand(cfg.num_layers, cfg.num_kv_heads, generator=generator).tolist()
        Profile("tiny", cfg.num_layers, cfg.num_kv_heads, scores).save(tmp_path / "p.json")
        options |= {"profile": str(tmp_path / "p.json"), "retrieval_heads": 0.5,
                    "sparse_pattern": "streaming(4,16)"}  # fmt: skip
    llm = make(tiny_llama, **options, hooks=EngineHooks(prompt_stand_in=lambda ids: kept.tolist()))
    lengths, tokens = _lengths_per_step(llm, prompt, 5)
    head_map = plan_of(llm).head_map
    rings = [head_map.entry(layer, h).pattern.startswith("streaming")
             for layer in range(cfg.num_layers) for h in range(cfg.num_kv_heads)]  # fmt: skip
    assert any(rings) == streaming
    picked = kept.flatten().tolist() if budget else [len(prompt)] * len(rings)
    want = [RING if ring else k for ring, k in zip(rings, picked, strict=True)]
    assert lengths[0] == want
    for step, row in enumerate(lengths):  # every entry one token more a step (a ring: full)
        assert row == [w if ring else w + step for ring, w in zip(rings, want, strict=True)]
    assert len(lengths) >= 4 and tokens[0] == 0


@pytest.mark.parametrize("budget", [0.5, 0.35])
def test_kept_counts_measured_apart_are_what_the_engine_keeps(tiny_llama, budget):
    """What a benchmark gives a stand-in prompt (``eval.profile.kept_counts`` on the model)
    is what the engine's own Ada-SnapKV keeps of that prompt, entry by entry."""
    prompt = _prompts([150], seed=6)[0]
    llm = make(tiny_llama, kv_budget=budget, kv_policy="ada_snapkv")
    lengths, _ = _lengths_per_step(llm, prompt, 2)
    want = kept_counts(llm.engine.model, prompt, llm.engine.lanes.resident.runner.budget)
    assert lengths[0] == want.flatten().tolist()
    assert len(set(lengths[0])) > 1  # the policy's heads differ


@pytest.mark.parametrize(
    "arena_kib,options,tier",
    [
        (None, {}, "gpu"),
        (700, {"offload": "head"}, "stream"),
        (700, {"offload": "hybrid", "cpu_share": 0.5, "gpu_window": 16}, "hybrid"),
    ],
)
def test_a_stand_in_prompt_decodes_in_every_tier(wide_llama, prompt, arena_kib, options, tier):
    """Without a budget, in each tier of the plan (resident, streamed, hybrid): the hook is
    asked once for the prompt, its decode steps run from token 0 (the prompt not run)."""
    given = []
    arena = None if arena_kib is None else arena_kib * 1024
    hooks = EngineHooks(prompt_stand_in=lambda ids: given.append(len(ids)) or [[1] * 4] * 8)
    llm = make(wide_llama, arena, hooks=hooks, **options)
    out = llm.generate(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert given == [len(prompt)] and out.token_ids[0] == 0 and len(out.token_ids) == 6
    assert plan_of(llm).head_map.count(tier) > 0
    assert out.stats.prompt_tokens == len(prompt)


def test_stand_in_prompts_keep_the_given_counts_on_every_rank(wide_llama, prompt, tmp_path):
    """Under two ranks with copied heads: each rank's entries (its own heads, then its
    copies) hold the counts given for their (layer, kv head), every copy of a head the
    same, a streaming head its ring; the ranks' decode tables as wide every step."""
    generator = torch.Generator().manual_seed(12)
    kept = torch.randint(1, len(prompt) + 1, (8, 4), generator=generator).tolist()
    options = {"profile": _random_profile(tmp_path / "profile.json", 8, 4),
               "retrieval_heads": 0.25, "sparse_pattern": "streaming(4,16)", "kv_budget": 0.9,
               "kv_policy": "ada_snapkv", **FREE_COPIES, "max_context": 4096}  # fmt: skip
    case = {**_case(wide_llama, prompt, options), "batch": [150, 75, 100], "stand_in": kept}
    (result,) = run_cases(2, [case], tmp_path)
    assert "entries copied" in result["summary"]
    patterns = result["patterns"]
    for heads, rank_kept in zip(result["rank_heads"], result["kept"], strict=True):
        for length, lengths in zip(case["batch"], rank_kept, strict=True):
            want = [min(RING if patterns[layer][h].startswith("streaming") else kept[layer][h],
                        length) for layer, hs in enumerate(heads) for h in hs]  # fmt: skip
            assert lengths == want
    assert result["widths"][0] and result["widths"][0] == result["widths"][1]
    assert all(tokens[0] == 0 for tokens in result["tokens"])

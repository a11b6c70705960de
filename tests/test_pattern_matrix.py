"""Patterns x budget policies x offload modes, end to end: every combination either runs and
equals an independent chunked model whose heads are masked by the same estimated patterns,
or is refused in one line.

The oracle recomputes the prompt chunk by chunk with dense fp32 attention, each resident
head masked by ``estimate()`` over that chunk's queries and keys (offloaded heads attend in
full unless they hold per-head pages); decode tokens attend every key, or the sink and
window for streaming heads."""

from __future__ import annotations

import pytest
import torch

from conftest import plan_of, ran_in, random_profile
from headspace import SamplingParams, UserError
from headspace.attention.patterns import estimate
from headspace.attention.reference import reference_attention
from headspace.kv.spec import KVSpec, Pattern, prefill_ring
from headspace.model.config import load_config
from headspace.planner.sparsity import prefill_gathers
from test_offload import CHUNK, PAGE, _prompts, make

PATTERNS = ["full", "streaming(4,40)", "vertical_slash(6,70)", "block_sparse(1)"]
POLICIES = [None, "snapkv", "ada_snapkv", "headkv"]
OFFLOADS = ["none", "head", "layer"]
BUDGET = 120  # tokens kept per entry (on average) of a 420-token prompt
PROMPT, STEPS = 420, 4


def _profile(path, config) -> str:
    return random_profile(path, config.num_layers, config.num_kv_heads, seed=3)


def _oracle_logits(llm, tokens: list[int], prompt_len: int) -> torch.Tensor:
    """fp32 logits ``[tokens - prompt_len + 1, vocab]``: the prompt's last token, then each
    decoded one, through the chunked masked model described in the module doc."""
    model, head_map = llm.engine.model, plan_of(llm).head_map
    group = model.config.num_queries_per_kv
    patterns = [
        [Pattern.parse(e.pattern) for e in head_map.layer(layer) for _ in range(group)]
        for layer in range(model.config.num_layers)
    ]  # as the head map says (shared pages leave streamed entries full)
    cache: dict[int, torch.Tensor] = {}  # layer -> [2, tokens so far, kv_heads, dim]

    def attention(layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        keys = kv if layer not in cache else torch.cat([cache[layer], kv], 1)
        cache[layer] = keys
        q_first, (k, v) = q.transpose(0, 1), keys.transpose(1, 2)  # [heads, tokens, dim]
        decoding = keys.shape[1] > prompt_len
        layer_patterns = [p if (p.kind == "streaming" or not decoding) else Pattern()
                          for p in patterns[layer]]  # fmt: skip
        mask = estimate(layer_patterns, q_first, k).dense()
        out, _ = reference_attention(q_first.double(), k.double(), v.double(), mask=mask)
        return out.transpose(0, 1).to(q.dtype)

    ends = [*range(CHUNK, prompt_len, CHUNK), prompt_len, *range(prompt_len + 1, len(tokens) + 1)]
    rows, start = [], 0
    with torch.inference_mode():
        for end in ends:
            hidden = model(torch.tensor(tokens[start:end]), torch.arange(start, end), attention)
            rows.append(model.logits(hidden[-1:]))
            start = end
    return torch.cat(rows[len(ends) - (len(tokens) - prompt_len) - 1 :])


def _engine_logits(llm, prompt: list[int]) -> tuple[torch.Tensor, list[int], object]:
    """The engine's prefill logits then each decode step's, ``[STEPS, vocab]``, through the
    public seams: generation's tokens, then ``logits`` fed them (its prefill and decode steps
    run what generation ran, and their greedy picks are generation's tokens); and stats."""
    out = llm.generate(prompt, SamplingParams(max_new_tokens=STEPS, ignore_eos=True))[0]
    rows = llm.logits(prompt + out.token_ids[:-1], decode_tokens=STEPS - 1)
    got = rows[len(prompt) - 1 :]
    assert got.argmax(-1).tolist() == out.token_ids
    return got, out.token_ids, out.stats


def _options(pattern: str, policy: str | None, offload: str, profile: str,
             spec: KVSpec | None = None) -> dict:  # fmt: skip
    options = {"offload": offload}
    own_pages = policy is not None or pattern.startswith("streaming")
    pages = spec.pages_for(PROMPT + STEPS) if spec else 0
    if offload != "none" and own_pages:  # per-head pages: 3 of 6 entries, and two slots of one
        held = pages  # (the 3 streaming entries, each its prefill ring at most: no budget)
        if pattern.startswith("streaming") and policy is None:
            held = min(pages, sum(prefill_ring(PAGE, *Pattern.parse(pattern).params, CHUNK)))
        options["arena"] = (3 * held + 2 * pages + 1) * spec.entry_page_bytes
    elif offload != "none":  # an arena of half the request's pages: some heads stream
        options["arena"] = pages // 2 * spec.full_page_bytes
    if pattern != "full":
        options |= {"profile": profile, "retrieval_heads": 0.5, "sparse_pattern": pattern}
    if policy is not None:
        options |= {"kv_budget": BUDGET, "kv_policy": policy, "profile": profile}
    return options


@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_pattern_policy_offload_matrix(tiny_llama, tmp_path, pattern, policy, offload):
    exact = make(tiny_llama)
    config = exact.engine.model.config
    profile = _profile(tmp_path / "p.json", config)
    spec = KVSpec.of(load_config(tiny_llama), PAGE, 4)  # fp32
    options = _options(pattern, policy, offload, profile, spec)
    own_pages = policy is not None or pattern.startswith("streaming")
    if "arena" in options and (pattern != "full" or own_pages):  # less what a layer gathers
        options["arena"] += prefill_gathers(config.num_kv_heads, config.num_queries_per_kv,
                                            config.head_dim, 4, config.max_context, CHUNK,
                                            budgets=policy is not None,
                                            pattern=options.get("sparse_pattern"))  # fmt: skip
    if own_pages and offload == "layer":  # per-head pages offload single heads
        with pytest.raises(UserError, match="offload"):
            make(tiny_llama, **options)
        return
    llm = make(tiny_llama, **options)
    prompt = _prompts([PROMPT], seed=11)[0]
    got, tokens, stats = _engine_logits(llm, prompt)
    head_map = plan_of(llm).head_map
    assert (offload == "none") == (head_map.num_offloaded == 0)
    offloaded = [e.pattern for e in head_map.entries if e.tier != "gpu"]
    assert not any(p.startswith("streaming") for p in offloaded)  # rings stay resident
    if own_pages and offloaded:  # host pages hold the offloaded entries' rows, no more
        most = max(sum(e.tier != "gpu" for e in head_map.layer(layer))
                   for layer in range(head_map.num_layers))  # fmt: skip
        host = ran_in(llm).runner.host
        assert host.rows == most < config.num_kv_heads and host.data.shape[1] == most
    if not own_pages:  # shared pages: offloaded heads attend in full
        assert set(offloaded) <= {"full"}
    if policy is None:  # every step: the oracle over the same tokens
        want = _oracle_logits(llm, prompt + tokens[:-1], len(prompt))
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    else:  # compression follows the prompt: its logits are the oracle's
        want = _oracle_logits(llm, prompt, len(prompt))
        torch.testing.assert_close(got[:1], want, atol=2e-4, rtol=2e-4)
        entries, total = len(head_map.entries), PROMPT + STEPS - 1
        rings = sum(e.pattern.startswith("streaming") for e in head_map.entries)
        budgets = {e.budget for e in head_map.entries}  # the head map's budget field
        assert budgets == ({BUDGET, 44} if rings else {BUDGET})
        held = (BUDGET + STEPS - 1) * (entries - rings) + 44 * rings
        if rings == 0 or policy == "snapkv":  # the policy's total, the rings' sink + window
            assert stats.kv_held_fraction == pytest.approx(held / (entries * total), abs=0.01)
        else:  # a share policy may give the retrieval heads more of a ring's budget
            most = held + BUDGET * rings
            assert held / (entries * total) - 0.01 < stats.kv_held_fraction
            assert stats.kv_held_fraction < most / (entries * total) + 0.01
    if pattern == "full" and policy is None:  # exact: the oracle is the causal model
        assert (
            tokens
            == exact.generate(prompt, SamplingParams(max_new_tokens=STEPS, ignore_eos=True))[
                0
            ].token_ids
        )


def test_prefill_patterns_change_the_prompt_logits(tiny_llama, tmp_path):
    """The oracle would agree with an engine that ignored the patterns only if the masks
    changed nothing: here they do."""
    exact = make(tiny_llama)
    profile = _profile(tmp_path / "p.json", exact.engine.model.config)
    prompt = _prompts([PROMPT], seed=11)[0]
    full = _engine_logits(exact, prompt)[0][0]
    for pattern in PATTERNS[1:]:
        llm = make(tiny_llama, profile=profile, retrieval_heads=0.5, sparse_pattern=pattern)
        assert (_engine_logits(llm, prompt)[0][0] - full).abs().max() > 1e-3, pattern


def test_embedded_model_with_block_sparse_heads_and_a_budget(embedded_dir, tmp_path):
    exact = make(embedded_dir)
    config = exact.engine.model.config
    profile = _profile(tmp_path / "p.json", config)
    options = _options("block_sparse(1)", "ada_snapkv", "none", profile)  # all resident
    llm = make(embedded_dir, **options)
    prompt = _prompts([PROMPT], seed=12)[0]
    got = _engine_logits(llm, prompt)[0]
    want = _oracle_logits(llm, prompt, len(prompt))
    torch.testing.assert_close(got[:1], want, atol=2e-4, rtol=2e-4)


def test_the_prefix_in_pieces_merged_by_lse_equals_one_piece(tiny_llama):
    from headspace.engine.hooks import EngineHooks

    prompt = _prompts([PROMPT], seed=13)[0]
    whole = _engine_logits(make(tiny_llama), prompt)[0]
    pieces_of_3_pages = EngineHooks(prefix_piece=48)  # pieces end mid-chunk
    pieces = _engine_logits(make(tiny_llama, hooks=pieces_of_3_pages), prompt)[0]
    torch.testing.assert_close(pieces, whole, atol=1e-5, rtol=1e-5)

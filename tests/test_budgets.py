"""KV budget policies: the kept sets against direct implementations on hand-made scores,
and the properties every policy keeps (a parametrised matrix over all policies)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from headspace.budgets import (
    LAYER_LOCAL,
    POLICIES,
    KVBudget,
    kept_positions,
    observation_scores,
    selected_counts,
)

HEAD_SCORES = torch.tensor([[1.0, 3.0], [0.0, 4.0]])  # [layers, kv heads], for headkv


def _scores(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_snapkv_keeps_each_heads_top_tokens_and_the_window():
    scores = [_scores([[0.1, 0.9, 0.2, 0.8, 0.3, 0.05], [0.7, 0.1, 0.6, 0.2, 0.3, 0.4]])]
    budget = KVBudget(5, "snapkv", window=2)  # 3 selected + 2 window tokens of 8
    kept = kept_positions(budget, scores, 8)[0]
    assert kept[0].tolist() == [1, 3, 4, 6, 7]
    assert kept[1].tolist() == [0, 2, 5, 6, 7]


def test_ada_snapkv_shares_a_layers_budget_by_score_after_a_floor():
    # head 0 holds the layer's five highest scores; head 1 only its floor of one
    scores = [_scores([[0.9, 0.8, 0.7, 0.6, 0.5, 0.01], [0.4, 0.02, 0.03, 0.04, 0.05, 0.06]])]
    counts = POLICIES["ada_snapkv"](scores, 3, floor=0.34)  # floor: int(0.34 * 3) = 1 each
    assert counts[0].tolist() == [5, 1]
    # default floor: int(0.2 * 3) = 0, so the layer's six highest scores, wherever they are
    kept = kept_positions(KVBudget(5, "ada_snapkv", window=2), scores, 8)[0]
    assert kept[0].tolist() == [0, 1, 2, 3, 4, 6, 7]
    assert kept[1].tolist() == [0, 6, 7]


def test_ada_snapkv_direct():
    """Against a direct implementation: floor per head, then the layer's top scores."""
    gen = torch.Generator().manual_seed(0)
    scores = [torch.rand(4, 50, generator=gen) for _ in range(3)]
    selectable, floor = 10, 0.2
    counts = POLICIES["ada_snapkv"](scores, selectable, floor=floor)
    for layer_scores, count in zip(scores, counts, strict=True):
        base = int(floor * selectable)
        taken = torch.zeros_like(layer_scores, dtype=torch.bool)
        for head in range(4):
            taken[head, layer_scores[head].topk(base).indices] = True
        remaining = layer_scores.masked_fill(taken, -1.0).flatten()
        for index in remaining.topk(4 * selectable - 4 * base).indices.tolist():
            taken.view(-1)[index] = True
        assert count.tolist() == taken.sum(1).tolist()


def test_headkv_divides_the_models_budget_by_head_scores():
    scores = [torch.rand(2, 100) for _ in range(2)]
    counts = POLICIES["headkv"](scores, 10, head_scores=HEAD_SCORES, floor=0.2)
    # floor 2 each; pool 4 x 8 = 32 shared as 1:3:0:4 -> 4, 12, 0, 16
    assert [c.tolist() for c in counts] == [[6, 14], [2, 18]]
    with pytest.raises(ValueError, match="profile"):
        POLICIES["headkv"](scores, 10)


def test_headkv_counts_need_only_the_shapes_of_the_scores():
    """The engine divides headkv's budget before any layer is scored (meta tensors of the
    scores' shape), then ranks each layer as it comes: the same counts and positions."""
    gen = torch.Generator().manual_seed(3)
    budget, prompt = KVBudget(0.3, "headkv", window=8), 90
    scores = [torch.rand(2, prompt - 8, generator=gen) for _ in range(2)]
    shapes = [torch.empty(s.shape, device="meta") for s in scores]
    counts = selected_counts(budget, shapes, prompt, HEAD_SCORES)
    assert [c.tolist() for c in counts] == [
        c.tolist() for c in selected_counts(budget, scores, prompt, HEAD_SCORES)
    ]
    assert counts[0].tolist() != counts[1].tolist()  # the profile's layers differ
    together = kept_positions(budget, scores, prompt, HEAD_SCORES)
    for layer, layer_scores in enumerate(scores):
        (alone,) = kept_positions(budget, [layer_scores], prompt, counts=counts[layer : layer + 1])
        assert all(torch.equal(a, b) for a, b in zip(alone, together[layer], strict=True))


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("value", [0.1, 0.25, 0.5, 1.0, 40])
def test_every_policy_keeps_a_valid_set(policy, value):
    gen = torch.Generator().manual_seed(1)
    prompt, budget = 200, KVBudget(value, policy, window=16)
    scores = [torch.rand(2, prompt - 16, generator=gen) for _ in range(2)]
    kept = kept_positions(budget, scores, prompt, head_scores=HEAD_SCORES)
    total = 0
    for layer in kept:
        for positions in layer:
            assert positions.tolist() == sorted(set(positions.tolist()))  # ascending, unique
            assert positions[-16:].tolist() == list(range(prompt - 16, prompt))  # the window
            assert 16 <= len(positions) <= prompt
            total += len(positions)
    assert total <= 4 * budget.tokens(prompt)  # the model's total, at most
    if policy != "headkv":  # per layer too
        for layer in kept:
            assert sum(map(len, layer)) <= 2 * budget.tokens(prompt)
    if value == 1.0:  # everything
        assert all(len(p) == prompt for layer in kept for p in layer)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(sorted(POLICIES)), st.integers(1, 4), st.integers(20, 120),
       st.sampled_from([0.1, 0.3, 0.7]), st.integers(0, 2**16))  # fmt: skip
def test_a_layer_local_policy_ranks_each_layer_alone(policy, heads, prompt, value, seed):
    """The engine ranks a layer-local policy's layers one at a time, as they are scored: the
    same positions as ranking them all at once (the one policy that is not, headkv, differs
    when a layer is ranked alone)."""
    gen = torch.Generator().manual_seed(seed)
    budget = KVBudget(value, policy, window=8)
    scores = [torch.rand(heads, prompt - 8, generator=gen) for _ in range(3)]
    head_scores = torch.rand(3, heads, generator=gen) + 0.1
    together = kept_positions(budget, scores, prompt, head_scores)
    alone = [kept_positions(budget, [s], prompt, head_scores[i : i + 1])[0]
             for i, s in enumerate(scores)]  # fmt: skip
    same = all(torch.equal(a, b) for la, lb in zip(together, alone, strict=True)
               for a, b in zip(la, lb, strict=True))  # fmt: skip
    assert same or policy not in LAYER_LOCAL


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(POLICIES)), st.integers(1, 6), st.integers(1, 300),
       st.integers(0, 80), st.integers(0, 2**16))  # fmt: skip
def test_policies_never_exceed_the_budget_or_the_tokens(policy, heads, tokens, selectable, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = [torch.rand(heads, tokens, generator=gen) for _ in range(2)]
    head_scores = torch.rand(2, heads, generator=gen)
    counts = POLICIES[policy](scores, selectable, head_scores=head_scores)
    for count in counts:
        assert ((count >= 0) & (count <= tokens)).all()
    assert sum(int(c.sum()) for c in counts) <= 2 * heads * selectable


def test_a_token_budget_below_the_window_is_refused():
    with pytest.raises(ValueError, match="below the 32-token observation window"):
        KVBudget(2)
    assert KVBudget(32).tokens(1000) == 32


def test_budget_values_are_checked_and_converted():
    assert KVBudget(0.25).tokens(1000) == 250 and KVBudget(300).tokens(1000) == 300
    assert KVBudget(0.01).tokens(1000) == 32  # never below the window
    assert KVBudget(5000).tokens(1000) == 1000
    for bad in (0.0, 1.5, 0, -3, "0.5", True):
        with pytest.raises(ValueError):
            KVBudget(bad)
    with pytest.raises(ValueError, match="kv_policy"):
        KVBudget(0.5, "h2o")
    for bad_pool in (0, 4, 7.0):  # an even width would shift the scores by half a token
        with pytest.raises(ValueError, match="kv_pool"):
            KVBudget(0.5, pool=bad_pool)


def test_observation_scores_equal_a_direct_computation():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(4, 8, 16, generator=gen)  # 4 query heads over 2 kv heads, window 8
    k = torch.randn(2, 40, 16, generator=gen)
    scores = observation_scores(q, k, pool=1)
    expected = torch.zeros(2, 32)
    for head in range(4):
        for i in range(8):
            position = 32 + i
            logits = q[head, i] @ k[head // 2, : position + 1].T / 4.0
            weights = torch.softmax(logits, dim=0)
            expected[head // 2] += weights[:32] / 2  # mean over the 2 query heads
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    pooled = observation_scores(q, k, pool=7)  # a max over 7 neighbours, never below the raw
    assert (pooled >= scores - 1e-6).all()
    assert torch.allclose(pooled[:, 10], scores[:, 7:14].max(1).values)
    pooled = observation_scores(q, k)  # the default: 15 neighbours, 7 either side
    assert torch.allclose(pooled[:, 10], scores[:, 3:18].max(1).values)
    assert torch.allclose(pooled[:, 0], scores[:, :8].max(1).values)  # clipped at the edge

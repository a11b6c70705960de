"""Head-to-rank solvers: every assignment valid; greedy, GA and FairKV never worse than
uniform; exact search optimal against brute force, GA within 2% of it; fair-copying's shares
level their ranks (a parametrised matrix over all solvers, property tests over random costs)."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from headspace.parallel import SOLVERS, HeadCost, check_assignment, rank_loads, solve, solve_layers
from headspace.parallel.assignment import (
    LayerCosts,
    balance_summary,
    fill_shares,
    makespan,
    single,
)

costs_strategy = st.lists(
    st.builds(HeadCost, st.floats(0, 10, allow_nan=False), st.floats(0, 1, allow_nan=False),
              st.floats(0, 0.5, allow_nan=False)),
    min_size=0, max_size=10,
)  # fmt: skip


@st.composite
def two_phases(draw, max_heads: int = 10) -> LayerCosts:
    """A layer's costs in two phases (each head's prefill and decode) and their weights: ties,
    heads with nothing to divide, copies that cost, a phase of weight 0."""
    num_heads = draw(st.integers(1, max_heads))
    phase = st.lists(st.builds(HeadCost, st.sampled_from([0.0, 1.0, 2.0]) | st.floats(0, 10),
                               st.floats(0, 1), st.sampled_from([0.0, 0.3])),
                     min_size=num_heads, max_size=num_heads)  # fmt: skip
    weights = (draw(st.sampled_from([0.0, 1.0]) | st.floats(0, 1)), draw(st.floats(0.01, 1)))
    return LayerCosts((tuple(draw(phase)), tuple(draw(phase))), weights)


def _random_costs(num_heads: int, seed: int) -> list[HeadCost]:
    draw = random.Random(seed)
    return [HeadCost(draw.lognormvariate(0, 1), draw.uniform(0, 0.2)) for _ in range(num_heads)]


def _brute_force(costs: list[HeadCost], num_ranks: int) -> float:
    return min(makespan(costs, single(ranks), num_ranks)
               for ranks in itertools.product(range(num_ranks), repeat=len(costs)))  # fmt: skip


@pytest.mark.parametrize("name", sorted(SOLVERS))
@settings(max_examples=25, deadline=None)
@given(costs=costs_strategy, num_ranks=st.integers(1, 5), replicas=st.integers(0, 3))
@example(  # a head whose divisible work is the least positive float: no copy with no share
    costs=[HeadCost(2.0, 1.0, 0.0), HeadCost(3.0, 1.0, 0.0), HeadCost(3.0, 0.0, 0.5),
           HeadCost(3.0, 1.0, 0.0), HeadCost(2.2250738585072014e-308, 0.0, 0.0)],
    num_ranks=3, replicas=3,
)  # fmt: skip
def test_every_solver_assigns_each_head_within_the_replication_budget(name, costs, num_ranks,
                                                                      replicas):  # fmt: skip
    assignment = solve(name, costs, num_ranks, replicas=replicas)
    check_assignment(assignment, len(costs), num_ranks, replicas)
    loads = rank_loads(costs, assignment, num_ranks)
    split = sum(c.split for c in costs)  # every head's divisible work done exactly once
    fixed = sum((c.fixed + (c.copy if len(copies) > 1 else 0.0)) * len(copies)
                for c, copies in zip(costs, assignment, strict=True))  # fmt: skip
    assert sum(loads) == pytest.approx(split + fixed, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("name", sorted(SOLVERS))
@settings(max_examples=20, deadline=None)
@given(costs=two_phases(), num_ranks=st.integers(1, 4), replicas=st.integers(0, 2))
def test_every_solver_balances_two_phases_at_once(name, costs, num_ranks, replicas):
    """Over both phases every assignment is valid, and the searches are never worse than
    uniform on the phases' weighted sum of slowest ranks."""
    assignment = solve(name, costs, num_ranks, replicas=replicas)
    check_assignment(assignment, costs.num_heads, num_ranks, replicas)
    if name in ("greedy", "ga", "fairkv", "exact"):
        uniform = makespan(costs, solve("uniform", costs, num_ranks), num_ranks)
        assert makespan(costs, assignment, num_ranks) <= uniform * (1 + 1e-12)


@settings(max_examples=30, deadline=None)
@given(costs=two_phases(max_heads=6), num_ranks=st.integers(1, 3))
def test_exact_is_optimal_over_two_phases(costs, num_ranks):
    every = itertools.product(range(num_ranks), repeat=costs.num_heads)
    optimum = min(makespan(costs, single(ranks), num_ranks) for ranks in every)
    assert makespan(costs, solve("exact", costs, num_ranks), num_ranks) <= optimum * (1 + 1e-12)


def test_two_phases_keep_even_heads_where_one_phase_costs_alike():
    # Ada-SnapKV's heads: alike at prefill, uneven at decode. Decode alone gives the heavy
    # heads a rank each and piles the light ones up (prefill waits for four heads); both
    # phases keep two heads a rank and pair each heavy head with light ones
    prefill = tuple(HeadCost(1.0) for _ in range(8))
    decode = tuple(HeadCost(c) for c in (6.0, 5.0, 0.2, 0.1, 0.1, 0.3, 0.2, 0.1))
    both = LayerCosts((prefill, decode), (1 / 8, 1 / 12))
    for name in ("greedy", "ga", "fairkv", "exact"):
        alone = rank_loads(prefill, solve(name, decode, 4), 4)
        assert max(alone) >= 3.0, name
        assignment = solve(name, both, 4)
        assert rank_loads(prefill, assignment, 4) == [2.0] * 4, name
        assert makespan(decode, assignment, 4) == pytest.approx(6.1), name


@pytest.mark.parametrize("name", ["greedy", "ga", "fairkv", "exact"])
@settings(max_examples=30, deadline=None)
@given(costs=costs_strategy, num_ranks=st.integers(1, 5), replicas=st.integers(0, 2))
def test_searches_are_never_worse_than_uniform(name, costs, num_ranks, replicas):
    uniform = makespan(costs, solve("uniform", costs, num_ranks), num_ranks)
    found = makespan(costs, solve(name, costs, num_ranks, replicas=replicas), num_ranks)
    assert found <= uniform * (1 + 1e-12)


def test_greedy_can_beat_lpt_and_uniform_is_kept_when_better():
    # LPT's classic bad case: 3, 3, 2, 2, 2 on two ranks gives 7 where 6 is possible
    costs = [HeadCost(c) for c in (3, 3, 2, 2, 2)]
    assert makespan(costs, solve("greedy", costs, 2), 2) == 6
    assert makespan(costs, solve("exact", costs, 2), 2) == 6
    assert makespan(costs, solve("uniform", costs, 2), 2) == 8  # blocks of heads: 3+3+2
    # moves out of the busiest rank, the pair of ranks ending lowest first: 14 by LPT, 13
    # (the optimum) by its moves; taking the move that levels all three ranks best stays 14
    costs = [HeadCost(c) for c in (3, 3, 3, 7, 4, 8, 5, 6)]
    assert makespan(costs, solve("greedy", costs, 3), 3) == 13


@settings(max_examples=40, deadline=None)
@given(costs=st.lists(st.builds(HeadCost, st.floats(0, 10, allow_nan=False)), min_size=0,
                      max_size=7), num_ranks=st.integers(1, 4))  # fmt: skip
def test_exact_equals_brute_force(costs, num_ranks):
    found = makespan(costs, solve("exact", costs, num_ranks), num_ranks)
    optimum = _brute_force(costs, num_ranks) if costs else 0.0
    assert found <= optimum * (1 + 1e-12)  # uniform's copies may beat every single copy


def test_ga_is_within_two_percent_of_exact_where_greedy_is_not():
    hard = []  # layers where greedy's local optimum is more than 2% off: the GA's work
    for seed in range(120):
        draw = random.Random(seed)
        num_heads, num_ranks = draw.randint(6, 9), draw.randint(2, 4)
        costs = [HeadCost(round(draw.uniform(1, 10), 1)) for _ in range(num_heads)]
        optimum = makespan(costs, solve("exact", costs, num_ranks), num_ranks)
        if makespan(costs, solve("greedy", costs, num_ranks), num_ranks) > 1.02 * optimum:
            hard.append((costs, num_ranks, optimum, seed))
    assert len(hard) >= 3
    for costs, num_ranks, optimum, seed in hard:
        found = makespan(costs, solve("ga", costs, num_ranks, seed=seed), num_ranks)
        assert optimum <= found <= 1.02 * optimum


def test_exact_refuses_layers_too_large_to_search():
    with pytest.raises(ValueError, match="at most"):
        solve("exact", _random_costs(17, 0), 4)


def test_fair_copying_splits_a_dominant_head_and_levels_its_ranks():
    # one head carries most of the layer: without copies its rank waits for it alone
    costs = [HeadCost(10.0, 0.1)] + [HeadCost(1.0, 0.1) for _ in range(7)]
    greedy = makespan(costs, solve("greedy", costs, 4), 4)
    assert greedy == pytest.approx(10.1)
    assignment = solve("fairkv", costs, 4, replicas=3)
    check_assignment(assignment, 8, 4, 3)
    loads = rank_loads(costs, assignment, 4)
    assert max(loads) < 0.5 * greedy
    # the ranks holding a copy of the heavy head end level: the copies' shares fill them
    holders = [rank for rank, _ in assignment[0]]
    assert len(holders) >= 2
    assert max(loads[r] for r in holders) - min(loads[r] for r in holders) < 1e-9
    more = makespan(costs, solve("fairkv", costs, 4, replicas=6), 4)
    assert more <= max(loads) + 1e-12  # a larger budget never hurts


def test_a_head_is_copied_only_where_the_copy_pays_for_what_it_adds():
    # the dominant head of the test above: copies that add 0.1 s each still halve the layer,
    # copies that add 6 s would not: fairkv then keeps greedy's assignment
    for overhead, copied in ((0.1, True), (6.0, False)):
        costs = [HeadCost(10.0, 0.1, overhead)] + [HeadCost(1.0, 0.1, overhead)] * 7
        assignment = solve("fairkv", costs, 4, replicas=3)
        assert (len(assignment[0]) > 1) is copied
        if not copied:
            assert assignment == solve("greedy", costs, 4)
    # every copy of a divided head carries its overhead; an undivided head none
    loads = rank_loads([HeadCost(4.0, 0.0, 0.5)], (((0, 0.5), (1, 0.5)),), 2)
    assert loads == [2.5, 2.5]
    assert rank_loads([HeadCost(4.0, 0.0, 0.5)], (((0, 1.0),),), 2) == [4.0, 0.0]


def test_fair_copying_undoes_ties_one_copy_at_a_time():
    # six equal heads on four ranks: two ranks tie at two heads; one copy alone cannot lower
    # the busiest load, two can (each tied rank shares a head with an idle one)
    costs = [HeadCost(1.0) for _ in range(6)]
    assert makespan(costs, solve("fairkv", costs, 4, replicas=0), 4) == pytest.approx(2.0)
    assert makespan(costs, solve("fairkv", costs, 4, replicas=2), 4) == pytest.approx(1.5)
    # copies that cost 0.1 each: the first still lowers one tied rank (to 1.6), the second
    # the other; both ranks then carry a copy's cost too
    costs = [HeadCost(1.0, 0.0, 0.1) for _ in range(6)]
    assert makespan(costs, solve("fairkv", costs, 4, replicas=2), 4) == pytest.approx(1.6)


def test_fill_shares_water_fills_between_unequal_ranks():
    # rank 0 already holds 4 s, rank 1 nothing: a 6 s head copied on both ends at 5 s each
    costs = [HeadCost(4.0), HeadCost(6.0)]
    assignment = fill_shares(costs, (((0, 1.0),), ((0, 0.5), (1, 0.5))), 2)
    assert rank_loads(costs, assignment, 2) == pytest.approx([5.0, 5.0])
    assert dict(assignment[1]) == pytest.approx({0: 1 / 6, 1: 5 / 6})
    # a copy with nothing to do is dropped
    costs = [HeadCost(9.0), HeadCost(1.0)]
    assignment = fill_shares(costs, (((0, 1.0),), ((0, 0.5), (1, 0.5))), 2)
    assert assignment[1] == ((1, 1.0),)


def test_uniform_is_tensor_parallel_blocks_and_copies_when_ranks_outnumber_heads():
    costs = _random_costs(8, 0)
    assert [copies[0][0] for copies in solve("uniform", costs, 4)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert solve("uniform", costs[:2], 4) == (((0, 0.5), (1, 0.5)), ((2, 0.5), (3, 0.5)))


def test_assignment_checks_name_what_is_wrong():
    for bad, message in [((((0, 1.0),),), "heads assigned"), ((((0, 0.5), (0, 0.5)), ((1, 1.0),)),
                         "two copies"), ((((2, 1.0),), ((0, 1.0),)), "outside"),
                         ((((0, 0.7),), ((1, 1.0),)), "sum to 1"),
                         ((((0, 0.5), (1, 0.5)), ((1, 1.0),)), "extra copies")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            check_assignment(bad, 2, 2, 0)
    with pytest.raises(ValueError, match="balance must be one of"):
        solve("round_robin", _random_costs(2, 0), 2)


def test_summary_sums_each_layers_slowest_rank():
    costs = [[HeadCost(3.0), HeadCost(1.0)], [HeadCost(1.0), HeadCost(3.0)]]
    summary = balance_summary(costs, solve_layers("uniform", costs, 2), 2)
    assert summary["rank_seconds"] == [4.0, 4.0]  # balanced over the model ...
    assert summary["step_seconds"] == 6.0  # ... but each layer waits for its 3 s rank
    assert summary["imbalance_max_over_mean"] == pytest.approx(1.5)
    balanced = balance_summary(costs, solve_layers("greedy", costs, 2), 2)
    assert balanced["imbalance_max_over_mean"] == pytest.approx(1.5)  # one head each: no better
    copied = balance_summary(costs, solve_layers("fairkv", costs, 2, replicas=1), 2)
    assert copied["step_seconds"] == pytest.approx(4.0) and copied["extra_copies"] == 2


def test_copy_search_enumerates_every_scheme_within_the_budget():
    """FairKV's Algorithm 1: three heads, one extra copy over two ranks: no copy, or one of
    the three heads in two copies; a head never takes more copies than there are ranks."""
    from headspace.parallel.solvers.copy_search import schemes

    assert list(schemes(3, 1, 2)) == [(1, 1, 1), (1, 1, 2), (1, 2, 1), (2, 1, 1)]
    assert max(max(counts) for counts in schemes(2, 5, 3)) == 3
    assert all(sum(counts) - 4 <= 2 for counts in schemes(4, 2, 4))
    assert len(list(schemes(4, 2, 4))) == 1 + 4 + 4 + 6  # none, one head +1 or +2, two +1


def test_copy_search_finds_a_scheme_the_greedy_copier_misses():
    """Heads of 12 and 2 over four ranks with two extra copies: the 12 in three copies of 4
    beside the 2 makes every rank 4 or less, where copying one copy at a time stops at 6."""
    costs = [HeadCost(2.0), HeadCost(12.0)]
    searched = solve("copy_search", costs, 4, replicas=1)
    check_assignment(searched, 2, 4, 1)
    assert makespan(costs, searched, 4) == pytest.approx(4.0)
    assert makespan(costs, solve("fairkv", costs, 4, replicas=1), 4) == pytest.approx(6.0)


@settings(max_examples=40, deadline=None)
@given(costs=two_phases(max_heads=6), num_ranks=st.integers(1, 4), replicas=st.integers(0, 2))
def test_copy_search_is_never_worse_than_fairkv_or_exact(costs, num_ranks, replicas):
    searched = makespan(costs, solve("copy_search", costs, num_ranks, replicas=replicas),
                        num_ranks)  # fmt: skip
    fair = makespan(costs, solve("fairkv", costs, num_ranks, replicas=replicas), num_ranks)
    exact = makespan(costs, solve("exact", costs, num_ranks), num_ranks)
    assert searched <= fair * (1 + 1e-9) + 1e-12
    assert searched <= exact * (1 + 1e-9) + 1e-12


def test_copy_search_refuses_layers_too_large_to_search():
    with pytest.raises(ValueError, match="copy search takes at most 16"):
        solve("copy_search", _random_costs(15, 0), 4, replicas=2)

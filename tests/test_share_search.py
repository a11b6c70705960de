"""The hybrid share's search over decode steps' times (planner.share_search): it finds the
fastest share of a step-time curve, ignores what is not a like step, and follows the curve
when it moves."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from headspace.planner.share_search import LOWEST_SHARE, ShareSearch


def run(search: ShareSearch, step_seconds, steps: int, key=(1, 2), clock: float = 0.0):
    """Drive ``search`` for ``steps`` decode steps of batch ``key``, each taking
    ``step_seconds(share)``; returns the clock after them."""
    for _ in range(steps):
        share = search.observe(clock, key)
        clock += step_seconds(share)
    return clock


def v_shaped(best: float, base: float = 0.15, slope: float = 0.2):
    """Seconds of a step at ``share``: fastest at ``best``, slower either side."""
    return lambda share: base + slope * abs(share - best)


@settings(max_examples=60, deadline=None)
@given(best=st.floats(LOWEST_SHARE, 1.0), start=st.floats(LOWEST_SHARE, 1.0))
def test_it_settles_next_to_the_fastest_share(best, start):
    search = ShareSearch(start)
    run(search, v_shaped(best), 200)
    assert search.settled
    assert abs(search.share - best) <= search.min_step + 1e-9


def test_a_curve_fastest_at_an_end_settles_there():
    search = ShareSearch(0.5)
    run(search, v_shaped(1.0), 200)
    assert search.settled and search.share == 1.0
    search = ShareSearch(0.5)
    run(search, v_shaped(0.0), 200)  # below the range: its lowest share
    assert search.settled and search.share == search.low


def test_steps_lengthened_by_interference_do_not_move_it():
    """A step longer for an outside reason (host interference, now and then) does not move
    the search: it keeps the least of each share's steps."""
    rng = random.Random(0)
    search, clock, curve = ShareSearch(0.5), 0.0, v_shaped(0.35)
    for _ in range(200):
        share = search.observe(clock, "batch")
        clock += curve(share) + (0.5 if rng.random() < 0.15 else 0.0)
    assert search.settled and abs(search.share - 0.35) <= search.min_step + 1e-9


def test_a_short_generation_never_probes():
    """The first ``warmup_steps`` steps run at the start, whatever they take."""
    search, clock, shares = ShareSearch(0.5), 0.0, []
    for _ in range(search.warmup_steps):
        shares.append(search.observe(clock, "batch"))
        clock += v_shaped(0.9)(shares[-1])
    assert shares == [0.5] * search.warmup_steps and search.rounds == 0
    assert search.observe(clock, "batch") == 0.5  # then it times the centre first
    assert search.observe(clock + 0.2, "batch") != 0.5  # and a neighbour


def test_a_flat_noisy_curve_stops_probing():
    """Where noise alone separates the shares, the search holds after ``max_rounds``
    rounds instead of walking on."""
    rng = random.Random(1)
    search, clock = ShareSearch(0.5, margin=0.0), 0.0
    longest = search.warmup_steps + search.max_rounds * 3 * search.probe_steps + 1
    for _ in range(longest):
        search.observe(clock, "batch")
        clock += 0.15 * (1 + 0.1 * rng.random())
    assert search.settled


def test_batches_that_change_often_are_not_probed():
    """Under continuous batching the batch changes every few steps: once settled, the
    search stays at its centre (each batch's first steps never probe, and a batch that
    follows a short hold does not reopen it)."""
    search = ShareSearch(0.5)
    clock = run(search, v_shaped(0.4), 200)
    centre, shares = search.share, []
    for i in range(400):
        shares.append(search.observe(clock, i // 4))
        clock += v_shaped(0.4)(shares[-1])
    assert set(shares) == {centre}
    cut = ShareSearch(0.5)  # and, probing, a round cut short again and again ends it
    for i in range(300):
        cut.observe(i * 0.1, "same", interrupted=i % 4 == 3)  # rounds take 6 steps
    assert cut.settled and cut.rounds == cut.max_rounds


def test_steps_of_other_batches_or_after_a_prefill_do_not_compare():
    """A share is timed only by a step of the batch before it with nothing between: a
    batch that changes every step, or a prefill before every step, leaves it unmoved."""
    search, clock = ShareSearch(0.5), 0.0
    for i in range(100):
        share = search.observe(clock, i)  # a new batch each step
        clock += v_shaped(0.9)(share)
    assert search.share == 0.5 and not search.settled
    for _ in range(100):
        share = search.observe(clock, "same", interrupted=True)
        clock += v_shaped(0.9)(share)
    assert search.share == 0.5 and not search.settled
    run(search, v_shaped(0.9), 200, key="same", clock=clock)  # then like steps move it
    assert abs(search.share - 0.9) <= search.min_step + 1e-9


def test_it_follows_the_best_share_as_it_moves():
    """Settled, it looks either side again every ``recheck_steps`` steps: a history that
    grows moves the best share up (bench/NOTES.md), and the search goes after it."""
    search = ShareSearch(0.5, recheck_steps=32)
    clock = run(search, v_shaped(0.4), 200)
    assert search.settled and abs(search.share - 0.4) <= 0.05 + 1e-9
    run(search, v_shaped(0.8), 600, clock=clock)
    assert abs(search.share - 0.8) <= 0.05 + 1e-9


def test_a_new_batch_looks_again_at_once():
    """Settled, a change of batch runs one round either side of the centre without
    waiting ``recheck_steps``: a longer batch may want more on the CPU."""
    search = ShareSearch(0.5)
    clock = run(search, v_shaped(0.4), 200, key="short")
    assert search.settled and abs(search.share - 0.4) <= 0.05 + 1e-9
    run(search, v_shaped(0.7), 150, key="long", clock=clock)
    assert search.settled and abs(search.share - 0.7) <= 0.05 + 1e-9


def test_equal_steps_keep_the_start():
    search = ShareSearch(0.62)
    run(search, lambda share: 0.1, 100)
    assert search.settled and search.share == 0.62

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


def test_an_interrupted_step_is_not_counted():
    """A step longer for an outside reason (host interference, once per share) does not
    move the search: it keeps the least of each share's steps."""
    rng = random.Random(0)
    search, clock, curve = ShareSearch(0.5), 0.0, v_shaped(0.35)
    for _ in range(300):
        share = search.observe(clock, "batch")
        clock += curve(share) + (0.5 if rng.random() < 0.15 else 0.0)
    assert search.settled and abs(search.share - 0.35) <= search.min_step + 1e-9


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


def test_equal_steps_keep_the_start():
    search = ShareSearch(0.62)
    run(search, lambda share: 0.1, 100)
    assert search.settled and search.share == 0.62

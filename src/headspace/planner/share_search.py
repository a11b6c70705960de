"""The hybrid tier's CPU share, searched during decode from the steps' own times.

The planner's rates (:func:`headspace.planner.memory.hybrid_share`) give a starting share,
but the best one depends on the host (its cores, its memory's speed beside the page-locked
copies), on the length of the history (each layer's hand-off to the CPU weighs less as the
history grows) and on what else the machine runs: rates measured apart from the step
misjudged it (bench/NOTES.md). So the engine times its decode steps and moves the share
toward the faster: a compass search over ``[low, high]`` that measures the centre and the
shares one step either side, ``probe_steps`` decode steps each (the least of them, since
interruptions only lengthen a step), moves to the fastest, and halves the step when the
centre stays fastest (within ``margin``), down to ``min_step``. Then it holds, and checks
the centre's neighbours again every ``recheck_steps`` steps (the best share rises as the
history grows).

Steps count only between two decode steps of the same batch with nothing else between
(``key`` changes or ``interrupted`` start the round's measurements again). Pure arithmetic:
the engine supplies the times.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# the least CPU share the search tries: on the hosts measured the best share lay between
# 0.4 and 1 (docs/hybrid.md)
LOWEST_SHARE = 0.3


def lowest_share(start: float) -> float:
    """The least share a search from ``start`` tries: :data:`LOWEST_SHARE`, or ``start``
    where the planner's rates put it lower."""
    return min(start, LOWEST_SHARE)


@dataclass
class ShareSearch:
    """Where the search stands. ``share`` is the share the next decode step runs at; call
    :meth:`observe` once per decode step, before it runs, with the clock's seconds."""

    share: float  # the centre, and the share of the step about to run
    low: float = LOWEST_SHARE
    high: float = 1.0
    step: float = 0.1
    min_step: float = 0.05
    probe_steps: int = 2
    margin: float = 0.01  # a neighbour must be this much faster than the centre to win
    recheck_steps: int = 256
    settled: bool = False  # the step fell below min_step: holding the centre
    # the round's shares still to measure, their measured seconds, and the one running now
    _queue: list[float] = field(default_factory=list)
    _seconds: dict[float, list[float]] = field(default_factory=dict)
    _running: float | None = None
    _last: tuple[float, object] | None = None  # (clock, key) of the step before
    _held: int = 0  # steps run since the search settled

    def __post_init__(self):
        self.share = self._clamp(self.share)
        self._new_round()

    def observe(self, now: float, key: object, interrupted: bool = False) -> float:
        """The share for the decode step about to start at clock ``now`` (seconds) over
        batch ``key``; the time since the step before is that step's when its batch was the
        same and nothing ran between (``interrupted``: something did)."""
        last, self._last = self._last, (now, key)
        if last is None or last[1] != key or interrupted:
            self._restart_round()
        elif self._running is not None:
            self._seconds.setdefault(self._running, []).append(now - last[0])
        if self.settled:
            self._held += 1
            if self._held >= self.recheck_steps:  # look again either side of the centre
                self.settled, self._held = False, 0
                self.step = self.min_step
                self._new_round()
        if not self.settled and self._measured(self._queue[0]):
            self._queue.pop(0)
            if not self._queue:
                self._finish_round()
        self._running = None if self.settled else self._queue[0]
        return self.share if self._running is None else self._running

    # -- rounds ------------------------------------------------------------------------
    def _clamp(self, share: float) -> float:
        return round(min(max(share, self.low), self.high), 6)

    def _new_round(self) -> None:
        """Measure the centre, then one step above and below it (those within range)."""
        shares = [self.share, self._clamp(self.share + self.step),
                  self._clamp(self.share - self.step)]  # fmt: skip
        self._queue = list(dict.fromkeys(shares))
        self._seconds = {}

    def _restart_round(self) -> None:
        """Measurements of another batch do not compare: the round starts again."""
        if not self.settled:
            self._new_round()

    def _measured(self, share: float) -> bool:
        return len(self._seconds.get(share, ())) >= self.probe_steps

    def _finish_round(self) -> None:
        fastest = {share: min(seconds) for share, seconds in self._seconds.items()}
        best = min(fastest, key=fastest.get)
        if fastest[best] >= fastest[self.share] * (1 - self.margin):
            best = self.share
        if best == self.share:
            self.step /= 2
        self.share = best
        if self.step < self.min_step:
            self.settled, self._held = True, 0
            self.step = self.min_step
        else:
            self._new_round()

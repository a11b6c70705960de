"""The hybrid tier's CPU share, searched during decode from the steps' own times.

The planner's rates (:func:`headspace.planner.memory.hybrid_share`) give a starting share,
but the best one depends on the host (its cores, its memory's speed beside the page-locked
copies), on the length of the history (each layer's hand-off to the CPU weighs less as the
history grows) and on what else the machine runs: rates measured apart from the step
misjudged it (bench/NOTES.md). So the engine times its decode steps and moves the share
toward the faster: a compass search over ``[low, high]``. A batch's first ``warmup_steps``
decode steps run at the centre (a short generation never probes); then each round times
the centre and the shares one step either side in turn, ``probe_steps`` passes (the least
of each share's steps, since interruptions only lengthen a step; interleaved, so that a
drift of the host weighs on all three alike), moves to the fastest where it beats the
centre by ``margin``, and halves the step when the centre stays, down to ``min_step``. Then
it holds, and looks either side again (one round at ``min_step``) every ``recheck_steps``
steps (the best share rises as the history grows) and when a new batch comes after it held
``rebatch_steps``. After ``max_rounds`` rounds, finished or cut short, it holds, so that a
flat, noisy curve or a run of interruptions cannot keep it probing.

Steps count only between two decode steps of the same batch with nothing else between
(``key`` changes or ``interrupted`` start the round's measurements again). Pure arithmetic:
the engine supplies the times.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# the least CPU share the search tries where the planner's rates start it higher: on the
# hosts measured the best share lay between 0.4 and 1 (docs/hybrid.md)
LOWEST_SHARE = 0.3


def lowest_share(start: float) -> float:
    """The least share a search from ``start`` tries: :data:`LOWEST_SHARE`, or ``start``
    where the planner's rates put it lower."""
    return min(start, LOWEST_SHARE)


@dataclass
class ShareSearch:
    """Where the search stands. ``share`` is the centre (where it settles); call
    :meth:`observe` once per decode step, before it runs, with the clock's seconds: it
    returns the share that step runs at (the centre, or a neighbour being timed)."""

    share: float
    low: float = LOWEST_SHARE
    high: float = 1.0
    step: float = 0.1
    min_step: float = 0.05
    probe_steps: int = 2
    margin: float = 0.02  # a neighbour must be this much faster than the centre to win
    warmup_steps: int = 16
    recheck_steps: int = 256
    rebatch_steps: int = 32
    max_rounds: int = 12
    settled: bool = False  # holding the centre
    rounds: int = field(default=0, init=False)  # rounds finished or cut short
    # the round's shares still to time (in order), their times, the one running now
    _queue: list[float] = field(default_factory=list, init=False)
    _seconds: dict[float, list[float]] = field(default_factory=dict, init=False)
    _running: float | None = field(default=None, init=False)
    _last: tuple[float, object] | None = field(default=None, init=False)  # (clock, key)
    _batch_steps: int = field(default=0, init=False)  # decode steps of the current batch
    _held: int = field(default=0, init=False)  # steps since it last settled

    def __post_init__(self):
        self.share = self._clamp(self.share)
        self._new_round()

    def observe(self, now: float, key: object, interrupted: bool = False) -> float:
        """The share for the decode step about to start at clock ``now`` (seconds) over
        batch ``key``; the time since the step before is that step's when its batch was the
        same and nothing ran between (``interrupted``: something did)."""
        last, self._last = self._last, (now, key)
        new_batch = last is None or last[1] != key
        self._batch_steps = 1 if new_batch else self._batch_steps + 1
        if new_batch and self.settled and self._held >= self.rebatch_steps:
            self._recheck()
        if new_batch or interrupted:
            self._cut_round()
        elif self._running is not None:
            self._seconds.setdefault(self._running, []).append(now - last[0])
            self._queue.pop(0)
        if self.settled:
            self._held += 1
            if self._held >= self.recheck_steps:
                self._recheck()
        if not self.settled and not self._queue:
            self._finish_round()
        probing = not self.settled and self._batch_steps > self.warmup_steps
        self._running = self._queue[0] if probing else None
        return self.share if self._running is None else self._running

    # -- rounds ------------------------------------------------------------------------
    def _clamp(self, share: float) -> float:
        return round(min(max(share, self.low), self.high), 6)

    def _new_round(self) -> None:
        """Time the centre and one step above and below it (those within range), in turn,
        ``probe_steps`` times."""
        shares = [self.share, self._clamp(self.share + self.step),
                  self._clamp(self.share - self.step)]  # fmt: skip
        self._queue = list(dict.fromkeys(shares)) * self.probe_steps
        self._seconds = {}

    def _cut_round(self) -> None:
        """Times of another batch, or across other work, do not compare: the round starts
        again, and one cut short after some timing counts toward ``max_rounds``."""
        if self.settled:
            return
        if self._seconds:
            self.rounds += 1
            if self.rounds >= self.max_rounds:
                self._settle()
                return
        self._new_round()

    def _settle(self) -> None:
        self.settled, self._held, self.step = True, 0, self.min_step

    def _recheck(self) -> None:
        """One round at the least step either side of a settled centre."""
        self.settled, self._held, self.step, self.rounds = False, 0, self.min_step, 0
        self._new_round()

    def _finish_round(self) -> None:
        fastest = {share: min(seconds) for share, seconds in self._seconds.items()}
        best = min(fastest, key=fastest.get)
        if fastest[best] >= fastest[self.share] * (1 - self.margin):
            best = self.share
        if best == self.share:
            self.step /= 2
        self.share, self.rounds = best, self.rounds + 1
        if self.step < self.min_step or self.rounds >= self.max_rounds:
            self._settle()
        else:
            self._new_round()

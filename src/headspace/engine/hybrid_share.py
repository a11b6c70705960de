"""The hybrid tier's CPU share in a runner: searched from its decode steps' own times
(:mod:`headspace.planner.share_search`) where the user did not ask for one, else the plan's."""

from __future__ import annotations

import time
from collections.abc import Callable

from headspace.planner.plan import Plan
from headspace.planner.share_search import ShareSearch, lowest_share


class HybridShare:
    """The share the tiers' hybrid CPU sides (:class:`~headspace.tiers.hybrid.CpuSplit`)
    run at. ``other_work``: whether a prefill, a swap or a host-arena reallocation ran since
    the last decode step (that step's time then is not one to compare)."""

    def __init__(self, clock: Callable[[], float] | None = None):
        self.search: ShareSearch | None = None
        self.clock = clock or time.perf_counter  # the seconds decode steps are timed by
        self.other_work = False
        self._splits: list = []  # the current tiers' CPU sides

    def apply(self, plan: Plan, tiers: list, searched: bool) -> None:
        """The share for a new plan's ``tiers``: with ``searched`` and a hybrid plan, searched
        from the plan's, or, after another hybrid plan, from where the last search stood, a
        step either side; else the plan's."""
        self._splits = [t.cpu_split for t in tiers if t.cpu_split is not None]
        if plan.offload != "hybrid" or not searched:
            self.search = None
            return
        low, last = lowest_share(plan.cpu_share), self.search
        if last is None:
            self.search = ShareSearch(plan.cpu_share, low=low)
        else:
            self.search = ShareSearch(last.share, low=low, step=last.min_step)
        self._set(self.search.share)

    @property
    def share(self) -> float | None:
        """Where the search stands (its centre; a step may be timing a neighbour), else the
        share the steps run at; None without the tier. (Each read once: the view reads it
        while the lane's thread may apply a new plan.)"""
        search = self.search
        return search.share if search is not None else self.step_share

    @property
    def step_share(self) -> float | None:
        """The share the last (or next) decode step ran at; None without the tier."""
        splits = self._splits
        return splits[0].share if splits else None

    def before_step(self, seq_ids: list[int]) -> None:
        """An eager decode step of ``seq_ids`` is about to run: its share, and the last
        step's time to the search."""
        if self.search is not None:
            now, key = self.clock(), tuple(seq_ids)
            self._set(self.search.observe(now, key, self.other_work))
        self.other_work = False

    def _set(self, share: float) -> None:
        for split in self._splits:
            split.share = share


__all__ = ["HybridShare"]

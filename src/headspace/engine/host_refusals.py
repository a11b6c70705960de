"""What the scheduler does when the runner cannot have the host pages a step planned
(page-locking refused after the step was planned within the host budget): the requests that
needed them end alone, the others go on (a mixin over the scheduler's fields)."""

from __future__ import annotations

from collections import deque

from headspace.engine.step_plan import Sequence, StepPlan
from headspace.kv.block_table import HOST, BlockManager


class HostRefusals:
    """The host refusals of :class:`~headspace.engine.scheduler.Scheduler` (mixed into it)."""

    blocks: BlockManager
    running: list[Sequence]
    swapped: deque[Sequence]
    waiting: deque[Sequence]
    prefilling: Sequence | None
    piece: object | None
    _laid_for: tuple[int, ...]
    _chosen: tuple | None

    def host_refused(self, num_pages: int, plan: StepPlan) -> None:
        """The host arena could not grow past ``num_pages`` pages for ``plan``. The
        sequences that needed the growth end (finish reason "error", into ``plan.ended``):
        a prompt admitted onto host pages (its pages were reserved for its whole length)
        and the sequences swapped out to pages past them. A running sequence whose new
        token took such a page (nothing written there yet) moves to a free page below
        them, or ends where none is. ``plan`` keeps the rest (no resize or growth, both
        made; no copy for an ended sequence) and the host pool shrinks back."""
        ended = []
        admitted = plan.admitted
        if admitted is not None and HOST in self.blocks.tiers(admitted.seq_id):
            ended.append(admitted)
        past = self.blocks.holding_host_past(num_pages)
        ended += [s for s in self.swapped if s.seq_id in past]
        ended_pages = {p for s in ended for p in self.blocks.table(s.seq_id, HOST).pages}
        self._end_refused(ended, plan)
        past = self.blocks.holding_host_past(num_pages)
        moved_out = [s for s in self.running if s.seq_id in past
                     and not self.blocks.host_pages_below(s.seq_id, num_pages)]  # fmt: skip
        self._end_refused(moved_out, plan)
        plan.swap_out = [pair for pair in plan.swap_out if pair[1] not in ended_pages]
        plan.resize, plan.host_pages = None, 0
        self.blocks.pools[HOST].shrink(num_pages)

    def _end_refused(self, ended: list[Sequence], plan: StepPlan) -> None:
        """End ``ended`` (no host page for them) and take them out of ``plan``."""
        for seq in ended:
            if seq is self.prefilling:
                self.prefilling, self.piece = None, None
            self.finish(seq, "error")
        plan.ended += ended
        plan.decode = [s for s in plan.decode if s not in ended]
        plan.decode_pages = (
            self.blocks.pages([s.seq_id for s in plan.decode]) if plan.decode else {}
        )
        if plan.prefill is not None and plan.prefill.seq in ended:
            plan.prefill = None
        if plan.admitted in ended:
            plan.admitted = None

    def layout_refused(self, num_pages: int) -> Sequence | None:
        """The host pages of the layout last handed out could not be had (the arena holds
        ``num_pages``, maybe none: one of new rows is dropped first). The first waiting
        request it was chosen for ends (finish reason "error"; returned): a layout that
        needs host pages is chosen because that one does not fit resident. The next step
        plans for the others. The host pool forgets its cached prefixes (the arena may
        have lost them) and keeps only pages the arena holds; a layout outside the queue
        (teacher forcing) ends nothing."""
        host = self.blocks.pools[HOST]  # (nothing holds pages: the lane is idle)
        host.drop_cache()
        host.shrink(num_pages)
        chosen = [s for s in self.waiting if s.seq_id in self._laid_for]
        self._chosen, self._laid_for = None, ()
        if not chosen:
            return None
        seq = chosen[0]
        self.waiting.remove(seq)
        seq.finish_reason = "error"
        return seq

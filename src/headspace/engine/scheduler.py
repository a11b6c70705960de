"""Continuous batching within one lane: its layout, who is admitted, who grows, who is swapped
out and back in, which piece of a prompt is prefilled. Pure bookkeeping, no tensors:
``schedule()`` returns a :class:`StepPlan`, the only thing the lane's runner is handed, and
``laid_out`` takes back what laying a new layout out made.

The layout follows the sequences: each time nothing holds pages and requests wait, the
lane's :class:`LayoutPlanner` chooses one for the requests next in line (all resident if the
first fits, else the streaming plan for the first k that maximises the predicted
throughput), and a step carrying that layout alone is returned. Next in line is the first to
arrive or, with ``passes``, for requests arriving one by one, the shortest waiting prompt,
but none passed over by more than that many later ones (:func:`in_line`); a batch given at
once goes as given. Admission follows the layout in force. In the all-resident layout, with
the host tier allowed, a prompt is admitted when its pages fit (plus a page of headroom per
running sequence), like vLLM: a sequence that later finds no page for its next token swaps
the most recently admitted one out to host pages (its K/V copied, not recomputed) and that
one resumes when pages free up; where the host budget has no room for its pages, that one
ends alone (finish reason "error", the plan's ``ended``) and the others go on.
Without a host tier, and while heads stream, a prompt is admitted only when the pages it may
ever need fit beside those the running sequences may still need.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

from headspace.engine.host_refusals import HostRefusals
from headspace.engine.layout_plan import LayoutPlanner
from headspace.engine.prompt_pieces import PromptPieces
from headspace.engine.step_plan import (
    LayoutResult,
    PrefillPiece,
    Resize,
    SchedulerSettings,
    Sequence,
    StepPlan,
    in_line,
)
from headspace.errors import UserError
from headspace.kv.block_table import GPU, HOST, BlockManager, OutOfPages, PoolLayout
from headspace.planner.plan import Plan


class Scheduler(PromptPieces, HostRefusals):
    """Waiting, running and swapped-out sequences of one lane over its BlockManager.

    ``planner``: chooses the lane's layout each time nothing holds pages (None: the pools
    stay as given, a test's fixed layout); ``agree``: whether a page check holds everywhere
    (ranks with their own pools); ``host_claim(pages, rows, keep)``: whether the lane's host arena
    may grow to ``pages`` pages (of ``rows`` kv heads a layer; None: as now; its data copied
    over when ``keep``) within the host budget, those bytes then claimed from the other lanes
    (None: the host pool as given)."""

    def __init__(self, blocks: BlockManager, settings: SchedulerSettings,
                 planner: LayoutPlanner | None = None, agree: Callable[[bool], bool] = bool,
                 host_claim: Callable[[int, int | None, bool], bool] | None = None):  # fmt: skip
        self.blocks, self.settings, self.planner = blocks, settings, planner
        self.agree, self.host_claim = agree, host_claim
        self.step_tokens, self.piece_tokens = settings.step_tokens, settings.piece_tokens
        self.paced = True  # requests arrive one by one (a server), not as one batch
        self.chunk_limit: int | None = None  # a cap on new pieces (the offload lane runs)
        self.admit_before: int | None = None  # only sequences of lower ids are admitted
        self.prefilling: Sequence | None = None  # the prompt being computed, piece by piece
        self.prefill_next = 0  # its first token not yet computed
        self.piece: PrefillPiece | None = None  # a piece part-way through its layers
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.free_slots = list(range(settings.num_slots))
        self.num_swaps = 0  # sequences swapped out, counted over the scheduler's life
        # the layout in force, and what it implies
        self.plan: Plan | None = None
        self.planned: set[int] | None = None  # the sequences entry staging is sized for
        self.tiers: tuple[str, ...] = (GPU,)
        self.optimistic = False
        self.layer_slices = False  # whether the layout lets a chunk run a few layers a step
        self.mixes = False  # whether it lets a piece and decode rows run as one forward
        self.prefix_streams = False  # whether a piece's prefix is staged from host pages
        self._chosen: tuple[Plan, set[int] | None] | None = None  # handed out, not laid out
        self._resize: Resize | None = None
        self._host_target = 0
        self._laid_for: tuple[int, ...] = ()  # the queue the layout in force was chosen for
        self._fresh = False  # the lane's part changed: laid out for nobody first

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def idle(self) -> bool:
        """No sequence holds pages: the layout may change."""
        return not self.running and not self.swapped

    @property
    def has_work(self) -> bool:
        """Whether a step would do anything: sequences to run or wait for, a resize or a
        new part's layout due."""
        busy = bool(self.waiting or self.running or self.swapped)
        return busy or self._resize is not None or self._fresh

    # -- the layout ----------------------------------------------------------------------
    @property
    def has_work_due(self) -> bool:
        """Whether a change of the lane's part is due at its next step (a resize, or the
        layout of a new part)."""
        return self._resize is not None or self._fresh

    def replan(self) -> None:
        """The lane's part of the arena changed while nothing held pages: the next step
        lays it out for nobody (its pools follow), then for the requests next in line (a
        resize still due is moot)."""
        self._laid_for, self._fresh, self._resize = (), True, None

    def set_pages(self, num_pages: int) -> None:
        """The resident lane's pool takes ``num_pages`` pages: resized at the next step
        under the pages its sequences hold, else laid out anew (its pools, and their cached
        prefixes, made for the new part: another lane writes past it)."""
        if self.plan is not None and not self.idle:
            self.resize(num_pages)
            return
        self.replan()

    def laid_out(self, result: LayoutResult) -> None:
        """The runner laid out the plan of the last layout step: the pools follow it."""
        plan, self.planned = self._chosen
        self._chosen, self.plan = None, plan
        pools = result.pools
        if pools is None and self.blocks.pool.num_pages != plan.num_gpu_pages:
            pools = PoolLayout(plan.num_gpu_pages)  # (the same tensors; pools had moved)
        if pools is not None:
            self.blocks.reset(pools)
        host = self.blocks.pools[HOST]
        if result.host_reset:
            self.blocks.reset_host(result.host_pages)
        elif result.host_pages > host.num_pages:
            self.blocks.grow_host(result.host_pages)
        streams = plan.staging is not None
        self.tiers = ((GPU,) if plan.head_map.count("gpu") else ()) + ((HOST,) if streams else ())
        if self.blocks.per_entry:  # host pages are the entry table's, by entry
            self.tiers = (GPU,)
        self.layer_slices, self.mixes = result.layer_slices, result.mixes
        self.prefix_streams = streams  # a halved chunk would stage its prefix again
        self.optimistic = not streams and self.settings.swaps

    def resize(self, num_pages: int) -> None:
        """The resident pool takes ``num_pages`` pages at the next step, under the pages its
        sequences hold (renumbered here; the runner moves their K/V). Raises OutOfPages when
        they hold more."""
        moves, held = self.blocks.resize_gpu(num_pages)
        self._resize = Resize(num_pages, tuple(moves), held)

    def layout_for(self, seqs: list[Sequence]) -> StepPlan:
        """A step laying out the plan for ``seqs`` alone, outside the queue (teacher forcing;
        nothing may hold pages). UserError with the numbers when no plan holds them."""
        if not self.idle:
            raise UserError("requests are running: the layout cannot change under them")
        plan = self.planner.plan(seqs)
        self._chosen, self._laid_for, self._fresh = (plan, self.planned), (), False
        kept = self.blocks.pools[HOST].num_kept > 0
        return StepPlan(layout=plan, host_pages=plan.num_host_pages, host_kept=kept)

    def _layout_step(self) -> StepPlan | None:
        """A step that lays out a new layout, when nothing holds pages and requests wait
        (None when no layout is due, an empty step when the next in line cannot run in this
        lane now)."""
        if self.planner is None or not self.idle:
            return None
        kept = self.blocks.pools[HOST].num_kept > 0
        if self._fresh:  # a new part: pools that fit it before anything is admitted
            self._fresh = False
            plan = self.planner.empty()
            if plan is not None:
                self._chosen = (plan, None)
                return StepPlan(layout=plan, host_kept=kept)
            self.blocks.reset(PoolLayout(0))  # no room for a page: none until a layout
            self.plan = None
        if not self.waiting:
            return None
        queue = self._in_line()[: self.settings.max_batch]
        if tuple(s.seq_id for s in queue) == self._laid_for:  # chosen for them already
            return None
        self._laid_for = tuple(s.seq_id for s in queue)
        try:
            plan, planned = self.planner.choose(queue)
        except UserError:  # (the resident lane beside an offload lane: it waits for room)
            return StepPlan()
        kept = self._claim_host(plan, kept)
        if kept is None:  # another lane claimed the bytes since: planned again next step
            self._laid_for = ()
            return StepPlan()
        self._chosen = (plan, planned)
        return StepPlan(layout=plan, host_pages=plan.num_host_pages, host_kept=kept)

    def _in_line(self) -> list[Sequence]:
        """The waiting sequences in the order they are admitted: shortest first within the
        bound of ``passes`` for requests arriving one by one, a batch given at once as given
        (its throughput the same either way)."""
        return in_line(self.waiting, self.settings.passes if self.paced else 0)

    # -- host pages ------------------------------------------------------------------------
    def _claim_host(self, plan: Plan, kept: bool) -> bool | None:
        """Claim the host pages ``plan`` needs from the other lanes: whether the host pages'
        data is kept as the arena grows (``kept``, unless keeping the cached prefixes is
        what leaves no room: they are dropped), or None when the bytes are not there now."""
        if self.host_claim is None or not plan.num_host_pages:
            return kept
        rows = plan.host_rows or None
        if self.host_claim(plan.num_host_pages, rows, kept):
            return kept
        if kept and self.host_claim(plan.num_host_pages, rows, False):
            self.blocks.pools[HOST].drop_cache()
            return False
        return None

    def _host_room(self, num_pages: int) -> bool:
        """Whether ``num_pages`` host pages are free, growing the host pool (and asking the
        runner for the arena's pages in the step plan) within what ``host_claim`` grants."""
        pool = self.blocks.pools[HOST]
        if num_pages <= pool.num_free:
            return True
        wanted = pool.num_pages - pool.num_free + num_pages
        if self.host_claim is None or not self.host_claim(wanted, None, True):
            return False
        self.blocks.grow_host(wanted)
        self._host_target = max(self._host_target, wanted)
        return True

    # -- a step --------------------------------------------------------------------------
    def _fits(self, seq: Sequence) -> bool:
        pools = self.blocks.pools
        if self.optimistic:
            needed = self.blocks.pages_for(len(seq.prompt_ids)) + len(self.running)
            fits_alone = self.blocks.pages_for(seq.max_tokens) <= pools[GPU].num_pages
            return fits_alone and needed <= pools[GPU].num_free
        needed = self.blocks.pages_for(seq.max_tokens) + self._future_pages()
        return self.agree(all(needed <= pools[tier].num_free or
                              (tier == HOST and self._host_room(needed))
                              for tier in self.tiers))  # fmt: skip

    def _future_pages(self) -> int:
        """Pages the running sequences may still allocate before they hit their limits."""
        return sum(self.blocks.future_pages(s.seq_id, s.max_tokens) for s in self.running)

    def _accepts(self, seq: Sequence) -> bool:
        """Whether ``seq`` joins the running batch under the layout in force: the staging
        slots of entries in host pages hold what was planned, no more; while heads stream,
        only if the predicted throughput does not drop."""
        if self.planned is not None:
            return seq.seq_id in self.planned
        if self.planner is None or self.plan is None:
            return True
        return self.planner.joins(self.plan, self.running, seq)

    def schedule(self) -> StepPlan:
        """The next step: a layout when one is due (alone); else the resident pool's resize
        if asked for, a swapped-out sequence back in when it fits; the next waiting one
        admitted when no prompt is being prefilled; one token for every running sequence
        past its prompt (growing their pages, swapping the latest out on shortage); the next
        piece of the prompt being prefilled, in one forward with the decode rows where the
        layout mixes them."""
        layout = self._layout_step()
        if layout is not None:
            return layout
        plan = StepPlan(resize=self._resize)
        self._resize = None
        resumed = self.resume()
        if resumed is not None:
            plan.swap_in = resumed[1]
        if self.prefilling is None:
            plan.admitted = self.admit()
            if plan.admitted is not None:
                self.prefilling, self.prefill_next = plan.admitted, plan.admitted.num_cached
        batch = [s for s in self.running if s.started and s.num_scheduled < s.max_tokens]
        if batch:
            plan.decode, plan.swap_out, plan.ended = self.grow(batch)
        if plan.decode:
            plan.decode_pages = self.blocks.pages([s.seq_id for s in plan.decode])
        if self.prefilling is not None:
            plan.prefill = self._next_piece(plan.decode)
            plan.mixes = self.mixes and plan.prefill.layers == (0, plan.prefill.num_layers)
        plan.host_pages, self._host_target = self._host_target, 0
        return plan

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is; its pages return to their pools."""
        if seq is self.prefilling:
            self.prefilling, self.piece = None, None
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.finish_reason = "abort"
        else:
            self.finish(seq, "abort")

    def admit(self) -> Sequence | None:
        """Move the next waiting sequence into the batch if it fits (and the layout takes
        it); returns it (to prefill)."""
        if not self.waiting or self.swapped or not self.free_slots:
            return None
        if self.planner is not None and self.plan is None:  # no layout in force yet
            return None
        before = self.admit_before  # an earlier request of another lane waits for room
        seq = next((s for s in self._in_line() if before is None or s.seq_id < before), None)
        if seq is None:
            return None
        if len(self.running) >= self.settings.max_batch or not self._fits(seq):
            return None
        if not self._accepts(seq):
            return None
        try:
            seq.num_cached = self.blocks.allocate_prompt(
                seq.seq_id,
                seq.prompt_ids,
                self.tiers,
                reuse=self.settings.prefix_caching and seq.reuse_prefix,
            )
        except OutOfPages:  # reused pages were counted as free
            return None
        arrival = self.waiting.index(seq)
        del self.waiting[arrival]
        for passed in itertools.islice(self.waiting, arrival):
            passed.num_passed += 1
        seq.slot = self.free_slots.pop()
        self.running.append(seq)
        return seq

    def grow(self, batch: list[Sequence]) -> tuple[list[Sequence], list[tuple[int, int]],
                                                  list[Sequence]]:  # fmt: skip
        """A slot for one more token of every sequence of ``batch``; on shortage the most
        recently admitted sequences past their prompts are swapped out first (never one
        being prefilled), or ended (finish reason "error") where the host budget has no
        room for their pages: one request fails, the others go on. Returns (the sequences
        that step, (GPU page, host page) pairs the caller copies before anything reuses
        them, the sequences ended)."""
        pairs, stepping, ended, pools = [], list(batch), [], self.blocks.pools
        while True:
            needed = sum(self.blocks.pages_needed(s.seq_id) for s in stepping)
            if self.agree(all(needed <= pools[tier].num_free for tier in self.tiers)):
                break
            victims = [s for s in self.running if s.started]
            if not self.optimistic or not victims:
                raise OutOfPages(f"{needed} pages needed, fewer free")
            victim = victims[-1]
            swapped = self._swap_out(victim)
            if swapped is not None:
                pairs += swapped
            else:  # no room in the host budget: it ends, its pages back in the pool
                self.finish(victim, "error")
                ended.append(victim)
            if victim in stepping:
                stepping.remove(victim)
        for seq in stepping:
            self.blocks.append_token(seq.seq_id)
        return stepping, pairs, ended

    def _swap_out(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Swap ``seq`` out: its (GPU page, host page) pairs; None, and nothing moved,
        where the host budget has no room for its pages."""
        num_pages = len(self.blocks.table(seq.seq_id, GPU).pages)
        if not self._host_room(num_pages):
            return None
        pairs = self.blocks.swap_out(seq.seq_id)
        self.running.remove(seq)
        self.swapped.appendleft(seq)
        seq.num_swaps += 1
        self.num_swaps += 1
        return pairs

    def resume(self) -> tuple[Sequence, list[tuple[int, int]]] | None:
        """Swap the first swapped-out sequence back in when its pages (and a page of
        headroom per running sequence) fit: (sequence, (host page, GPU page) pairs)."""
        if not self.swapped:
            return None
        seq = self.swapped[0]
        num_pages = len(self.blocks.table(seq.seq_id, HOST).pages)
        if num_pages + len(self.running) + 1 > self.blocks.pools[GPU].num_free:
            return None
        self.swapped.popleft()
        pairs = self.blocks.swap_in(seq.seq_id)
        self.running.append(seq)
        return seq, pairs

    def finish(self, seq: Sequence, reason: str) -> None:
        """``seq`` ended: its pages and slot go back (once; a second call does nothing)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        else:
            return
        seq.finish_reason = reason
        self.blocks.free(seq.seq_id)
        self.free_slots.append(seq.slot)


__all__ = ["Scheduler", "SchedulerSettings", "Sequence", "StepPlan"]

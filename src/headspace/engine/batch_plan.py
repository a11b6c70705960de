"""What a batch's KV layout should be: the planner's plan for the sequences that would run
together (resident, heads streamed, per-entry pages; one rank's part under torchrun), the
predicted decode rate weighed when a streaming batch is sized, and the layout applied to the
runner and the scheduler each time nothing holds pages."""

from __future__ import annotations

from dataclasses import replace

from headspace.attention.cpu_decode import kernel_isa
from headspace.engine.config import EngineConfig
from headspace.engine.memory import flex_pool_pages
from headspace.engine.ranks import Ranks
from headspace.engine.scheduler import Scheduler, Sequence
from headspace.errors import UserError
from headspace.kv.block_table import GPU, HOST, BlockManager
from headspace.kv.spec import KVSpec
from headspace.parallel.dist import all_agree, host_min
from headspace.planner.entry_offload import entry_step_seconds, plan_entries
from headspace.planner.head_map import HeadMap
from headspace.planner.memory import Hardware
from headspace.planner.plan import Plan, plan_batch, step_seconds
from headspace.planner.profile import with_patterns
from headspace.planner.sparsity import with_budgets


class BatchPlanner:
    """Plans for a batch generator's arena (``runner``: its store, host pages, budget and
    profile; ``blocks``: the page pools a layout resets; ``chunk``: prompt tokens a prefill
    step runs at most)."""

    def __init__(self, model_config, config: EngineConfig, spec: KVSpec, runner,
                 blocks: BlockManager, weight_bytes: int, chunk: int, streamed_bytes: int = 0,
                 ranks: Ranks | None = None, hardware: Hardware | None = None):  # fmt: skip
        """``hardware``: the planner's rates in place of its defaults (a test's, to see a
        plan follow given rates)."""
        self.model_config, self.config, self.spec = model_config, config, spec
        self.runner, self.blocks, self.chunk = runner, blocks, chunk
        self.weight_bytes, self.ranks = weight_bytes, ranks
        self.streamed_bytes = streamed_bytes  # weights copied from the host per step
        # the planner's rates (no CPU attention where the kernel does not build); with
        # ``offload="auto"`` the hybrid tier is considered only on a GPU machine
        has_kernel = kernel_isa() is not None
        if ranks is not None:  # every rank plans alike, also over machines that differ
            has_kernel = all_agree(has_kernel)
            # ranks hold different weights: every rank weighs the most any of them holds
            self.weight_bytes = -host_min(-weight_bytes)
            self.streamed_bytes = -host_min(-streamed_bytes)
        self.hardware = hardware or (Hardware() if has_kernel else Hardware(cpu_attention_bytes=0))
        self.max_gpu_pages = None  # under flex, a layer's pool within int32 indices
        if config.runtime.attention_backend == "flex":
            self.max_gpu_pages = flex_pool_pages(spec)
        self.tiers: tuple[str, ...] = (GPU,)  # where a sequence takes pages in the layout
        self.planned: set[int] | None = None  # the sequences entry staging is sized for
        self.relaid_for: int | None = None  # the sequence the running ones moved for
        # a move refused (no plan, or one predicted slower): the request next in line and
        # the counts of requests holding pages and running; -1 and the running count for
        # the move back
        self._refused: tuple[int, ...] | None = None
        self._alone: tuple[int, bool] | None = None  # (a request, whether it fits resident)

    def plan(self, seqs: list[Sequence]) -> Plan:
        """The plan for ``seqs`` running together (UserError with the numbers if none)."""
        total = sum(self.spec.pages_for(s.max_tokens) for s in seqs)
        what = f"{len(seqs)} requests of {sum(s.max_tokens for s in seqs)} tokens"
        if len(seqs) == 1:
            what = f"a request of up to {seqs[0].max_tokens} tokens"
        if self.config.budgets.per_head_pages:
            return self._entry_plan(seqs, what)
        host = self.config.offload
        plan = plan_batch(self.spec, self.runner.store.num_bytes, total, offload=host.mode,
                          head_group=host.head_group, host_budget=self.runner.host.budget,
                          what=what, hw=self.hardware, cpu_share=host.hybrid_cpu_share,
                          gpu_window=host.gpu_window, num_seqs=len(seqs),
                          window_on_gpu=host.window_on_gpu,
                          auto_hybrid=self.config.runtime.on_gpu,
                          max_gpu_pages=self.max_gpu_pages)  # fmt: skip
        if self.ranks is not None:  # sized for the widest rank; the whole map, with its ranks
            return self.ranks.spread(plan, what)
        if self.config.budgets.retrieval_heads is not None:  # retrieval heads keep all
            plan.head_map = self._with_patterns(plan.head_map)
        return plan

    def _with_patterns(self, head_map: HeadMap) -> HeadMap:
        """The profile's retrieval heads keep every token; the others take the pattern."""
        budgets = self.config.budgets
        return with_patterns(head_map, self.runner.profile.retrieval, budgets.retrieval_heads,
                             budgets.sparse_pattern)  # fmt: skip

    def _entry_plan(self, seqs: list[Sequence], what: str) -> Plan:
        """Per-entry pages (budgets, streaming heads): patterns and budgets first, then
        which entries live in host pages if the batch does not fit (never a ring)."""
        config, spec, budget = self.config, self.spec, self.runner.budget
        head_map = HeadMap.all_gpu(spec.num_layers, spec.num_kv_heads)
        if config.budgets.retrieval_heads is not None:
            head_map = self._with_patterns(head_map)
        kept = None if budget is None else max(budget.tokens(len(s.prompt_ids)) for s in seqs)
        parts = None
        if self.ranks is not None:  # the whole map, with its ranks; each rank's entries
            head_map, parts = self.ranks.head_map, self.ranks.entry_parts()
        head_map = with_budgets(head_map, kept)  # rings keep their sink and window
        return plan_entries(spec, self.runner.store.num_bytes, head_map,
                            [s.max_tokens for s in seqs], self.bounds(seqs),
                            offload=config.offload.mode, host_budget=self.runner.host.budget,
                            what=what, parts=parts,
                            ring_chunk=self.chunk if budget is None else None)  # fmt: skip

    def bounds(self, seqs: list[Sequence]) -> list[int]:
        """Most tokens one entry of each sequence holds after its prompt."""
        budget = self.runner.budget
        if budget is None:
            return [s.max_tokens for s in seqs]
        return [budget.most_held(len(s.prompt_ids), s.max_tokens) for s in seqs]

    def rate(self, plan: Plan, seqs: list[Sequence]) -> float:
        """Predicted sequences x tokens/s of a decode step over ``seqs`` (roofline; with
        entries in host pages, over what each holds after its prompt)."""
        if plan.entry_staging:  # under torchrun: the slowest rank's step
            counts = [(plan.head_map.count("gpu"), plan.head_map.num_offloaded)]
            if self.ranks is not None:
                counts = self.ranks.entry_counts(plan.head_map)
            seconds = max(entry_step_seconds(self.spec, resident, offloaded, self.bounds(seqs),
                                             self.weight_bytes, self.hardware,
                                             self.streamed_bytes)
                          for resident, offloaded in counts)  # fmt: skip
        else:
            if plan.rank_map is not None:  # under torchrun: the widest rank's step
                plan = replace(plan, head_map=plan.rank_map)
            seconds, _ = step_seconds(self.model_config, plan, sum(s.max_tokens for s in seqs),
                                      self.spec.dtype_bytes, self.hardware,
                                      self.config.offload.hybrid_cpu_share,
                                      streamed_weights=self.streamed_bytes)  # fmt: skip
        return len(seqs) / seconds

    # -- the layout in force ---------------------------------------------------------------
    def replan(self, scheduler: Scheduler) -> None:
        """Lay out for the sequences next in line: all resident if the first fits, else the
        streaming plan for the first k that maximises the predicted throughput."""
        queue = list(scheduler.waiting)[: self.config.runtime.max_batch]
        best, best_rate, planned = self.plan(queue[:1]), 0.0, queue[:1]
        if best.staging is not None or best.entry_staging:
            best_rate = self.rate(best, planned)
            for k in range(2, len(queue) + 1):
                try:
                    plan = self.plan(queue[:k])
                except UserError:
                    break
                if (k_rate := self.rate(plan, queue[:k])) < best_rate:
                    break
                best, best_rate, planned = plan, k_rate, queue[:k]
        # entries in host pages: the staging slots hold what was planned, no more
        self.planned = {s.seq_id for s in planned} if best.entry_staging else None
        self.apply(best, scheduler)

    def relayout(self, scheduler: Scheduler) -> bool:
        """Move the requests that hold pages to another layout while they run, when the
        queue needs it (copies queued in order on the device): to a layout that streams
        heads when the request next in line can never fit the all-resident one and, by
        default, the move keeps the predicted tokens/s (:meth:`_to_streamed`), back to the
        all-resident one once everything holding pages and the request next in line fit it
        (:meth:`_to_resident`). False when nothing moves; never while a prompt is part-way
        through its prefill, nor in the modes that keep state per sequence (per-entry
        pages, sparse hybrid, ranks)."""
        offload, budgets = self.config.offload, self.config.budgets
        if not scheduler.running or scheduler.prefilling is not None or offload.mode == "none":
            return False
        if budgets.per_head_pages or offload.cpu_sparsity is not None or self.ranks is not None:
            return False
        if self.runner.plan.staging is not None:  # heads stream (no per-entry count a step)
            return self._to_resident(scheduler)
        return bool(scheduler.waiting) and self._to_streamed(scheduler)

    def _to_streamed(self, scheduler: Scheduler) -> bool:
        """Plan for the request next in line together with every request holding pages;
        the running ones' K/V is copied to host pages (swapped-out ones are there already),
        the arena takes the new layout, their resident entries are copied back into GPU
        pages beside their host pages, and the swapped-out ones run again. With the
        ``throughput`` relayout (the default) only where the plan's predicted tokens/s is
        at least the running ones' now: a step that streams heads is many times a resident
        one's, so the request mostly waits until the running ones end (at most the longest
        one's remaining tokens; nothing queued behind it is admitted meanwhile)."""
        head, running = scheduler.waiting[0], scheduler.running
        if self.blocks.pages_for(head.max_tokens) <= self.blocks.pool.num_pages:
            return False  # it fits this layout once pages free up
        holding = running + list(scheduler.swapped)
        key = (head.seq_id, len(holding), len(running))
        plan = self._plan_once(holding + [head], key)
        if plan is None or plan.staging is None:
            return False
        if self.config.offload.relayout == "throughput" and (
            self.rate(plan, holding + [head]) < self.rate(self.runner.plan, running)
        ):  # fmt: skip
            self._refused = key  # weighed again once these counts change
            return False
        self.ensure_host_pages(plan.num_host_pages)
        out = [pair for seq in running for pair in self.blocks.swap_out(seq.seq_id)]
        # (a layout that streams every head keeps host pages only)
        self._switch(plan, scheduler, out, self.blocks.attach if GPU in self.tiers else None,
                     holding)  # fmt: skip
        self.relaid_for = head.seq_id
        scheduler.resume_all()
        return True

    def _to_resident(self, scheduler: Scheduler) -> bool:
        """Each running request's resident entries are copied into its host pages (which
        then hold all of it), the arena takes the all-resident layout, and each request's
        pages come back into the GPU pool."""
        running = scheduler.running
        if scheduler.swapped:
            return False
        if scheduler.waiting and not self._fits_resident(scheduler.waiting[0]):
            return False
        plan = self._plan_once(running, (-1, len(running)))
        if plan is None or plan.staging is not None:
            self._refused = (-1, len(running))
            return False
        out = [pair for seq in running for pair in self.blocks.detach(seq.seq_id)]
        self._switch(plan, scheduler, out, self.blocks.swap_in, running)
        return True

    def _switch(self, plan: Plan, scheduler: Scheduler, out: list[tuple[int, int]],
                back, seqs: list[Sequence]) -> None:  # fmt: skip
        """Copy the (GPU page, host page) pairs ``out`` to the host under the layout in
        force, make ``plan`` the layout, then copy back the (host page, GPU page) pairs
        that ``back(seq_id)`` gives each of ``seqs`` (None: nothing comes back)."""
        self.runner.swap(out, to_host=True)
        self.planned = self.relaid_for = None
        self.apply(plan, scheduler)
        if back is not None:
            pairs = [pair for seq in seqs for pair in back(seq.seq_id)]
            self.runner.swap(pairs, to_host=False)

    def _plan_once(self, seqs: list[Sequence], key: tuple[int, ...]) -> Plan | None:
        """The plan for ``seqs``, or None when there is none; a refusal is remembered under
        ``key`` (see ``_refused``) and not planned again until the key changes."""
        if self._refused == key:
            return None
        try:
            return self.plan(seqs)
        except UserError:
            self._refused = key
            return None

    def _fits_resident(self, seq: Sequence) -> bool:
        """Whether ``seq`` alone runs all resident (remembered for one request)."""
        if self._alone is None or self._alone[0] != seq.seq_id:
            try:
                fits = self.plan([seq]).staging is None
            except UserError:
                fits = False
            self._alone = (seq.seq_id, fits)
        return self._alone[1]

    def apply(self, plan: Plan, scheduler: Scheduler | None = None) -> None:
        """Make ``plan`` the runner's layout and the page pools' (no sequence may hold GPU
        pages) and tell ``scheduler`` where sequences take pages and whether they may swap
        out."""
        self.ensure_host_pages(plan.num_host_pages, plan.host_rows or None)
        pools = self.runner.apply(plan)
        if pools is not None:
            self.blocks.reset(pools)
        streams = plan.staging is not None
        self.tiers = ((GPU,) if plan.head_map.count("gpu") else ()) + ((HOST,) if streams else ())
        if self.config.budgets.per_head_pages:  # host pages are the entry table's, by entry
            self.tiers = (GPU,)
        if scheduler is not None:
            scheduler.tiers = self.tiers
            scheduler.layer_slices = self.runner.layer_slices
            scheduler.prefix_streams = streams  # a halved chunk would stage its prefix again
            swaps = self.config.offload.mode != "none" and not self.config.budgets.per_head_pages
            scheduler.optimistic = not streams and swaps
            scheduler.grow_host = self.grow_host

    def grow_host(self, num_pages: int) -> str | None:
        """Grow the host pool to ``num_pages`` free pages; None when it did (under torchrun
        on every rank alike), else why not."""
        pool = self.blocks.pools[HOST]
        try:
            self.ensure_host_pages(pool.num_pages - pool.num_free + num_pages)
        except UserError as error:
            return str(error)
        return None

    def ensure_host_pages(self, num_pages: int, rows: int | None = None) -> None:
        """A host pool of at least ``num_pages`` (the runner's arena grows first), of
        ``rows`` kv heads a layer when given (a new arena and pool when that changes, for
        per-entry pages); raises UserError, on every rank alike, when the arena cannot
        grow."""
        pool = self.blocks.pools[HOST]
        if rows is not None and rows != self.runner.host.rows:  # nothing in host pages
            try:
                pages = self.runner.grow_host(num_pages, keep=False, rows=rows)
            except UserError:  # the arena was dropped: so are the pool's pages
                self.blocks.reset_host(0)
                raise
            self.blocks.reset_host(pages)
            return
        if num_pages > pool.num_pages:  # the same on every rank
            self.blocks.grow_host(self.runner.grow_host(num_pages, keep=pool.num_kept > 0))

    def worth_joining(self, scheduler: Scheduler):
        """While heads stream, a sequence joins the batch only if the predicted throughput
        does not drop (every byte of its history crosses PCIe each step)."""
        plan = self.runner.plan

        def accept(seq: Sequence) -> bool:
            running = scheduler.running
            if self.planned is not None:  # the staging slots hold what was planned
                return seq.seq_id in self.planned
            if seq.seq_id == self.relaid_for:  # the layout was made for it
                return True
            if plan.staging is None or not running:
                return True
            return self.rate(plan, running + [seq]) >= self.rate(plan, running)

        return accept

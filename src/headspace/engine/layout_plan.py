"""What a lane's KV layout should be: the planner's plan for the sequences that would run
together in the lane's part of the arena (resident, heads streamed or attended on the CPU,
per-entry pages; one rank's part under torchrun), and the predicted decode rate weighed when
a streaming batch is sized or joined. Pure arithmetic over the planner (no tensors): the
scheduler asks, the runner lays the plan out."""

from __future__ import annotations

from dataclasses import dataclass, replace

from headspace.budgets import KVBudget
from headspace.engine.config import EngineConfig
from headspace.engine.ranks import Ranks
from headspace.engine.step_plan import Sequence
from headspace.errors import UserError
from headspace.kv.host_store import HostKVArena
from headspace.kv.spec import KVSpec
from headspace.model.config import ModelConfig
from headspace.planner.entry_offload import entry_step_seconds, plan_entries
from headspace.planner.head_map import HeadMap
from headspace.planner.memory import Hardware
from headspace.planner.plan import Plan, plan_batch, step_seconds
from headspace.planner.profile import Profile
from headspace.planner.sparsity import with_budgets


@dataclass
class LaneMemory:
    """The bytes a lane plans within: ``region`` of the GPU arena, and of host memory for KV
    pages what its ``host_arena`` may hold (beside the other lanes'), else ``host`` (None: no
    bound); ``resident_only``: its plans never offload (the resident lane beside an
    offload lane)."""

    region: int
    host: int | None
    resident_only: bool = False
    host_arena: HostKVArena | None = None

    @property
    def host_bytes(self) -> int | None:
        return self.host if self.host_arena is None else self.host_arena.budget


@dataclass(frozen=True)
class PlanTerms:
    """What every plan of an engine's lanes is made from, whatever part of the arena: the
    model's config and the engine's options, the page shape (``spec``), prompt tokens a
    prefill step runs at most (``chunk``), weight bytes read from HBM and copied from the
    host per step, the planner's rates (``hardware``), the profile and ranks (None: none),
    the most pages a layer's pool may hold (FlexAttention's int32 indices; None: no bound),
    and whether each (layer, kv head) has its own pages (budgets, streaming heads)."""

    model_config: ModelConfig
    config: EngineConfig
    spec: KVSpec
    chunk: int
    weight_bytes: int
    streamed_bytes: int
    hardware: Hardware
    profile: Profile | None = None
    ranks: Ranks | None = None
    max_gpu_pages: int | None = None
    entry_pages: bool = False


class LayoutPlanner:
    """Plans for one lane: ``terms`` (:class:`PlanTerms`) within ``memory``, each entry
    keeping what ``budget`` says of a prompt (None: all)."""

    def __init__(self, terms: PlanTerms, memory: LaneMemory, budget: KVBudget | None = None):
        self.terms, self.memory, self.budget = terms, memory, budget

    def plan(self, seqs: list[Sequence]) -> Plan:
        """The plan for ``seqs`` running together (UserError with the numbers if none)."""
        total = sum(self.terms.spec.pages_for(s.max_tokens) for s in seqs)
        what = f"{len(seqs)} requests of {sum(s.max_tokens for s in seqs)} tokens"
        if len(seqs) == 1:
            what = f"a request of up to {seqs[0].max_tokens} tokens"
        if self.terms.entry_pages:
            return self._entry_plan(seqs, what)
        memory, options = self.memory, self.terms.config.offload_plan_options()
        if memory.resident_only:
            options["offload"] = "none"
        plan = plan_batch(self.terms.spec, memory.region, total, host_budget=memory.host_bytes,
                          what=what, hw=self.terms.hardware, num_seqs=len(seqs),
                          auto_hybrid=self.terms.config.runtime.on_gpu,
                          max_gpu_pages=self.terms.max_gpu_pages, **options)  # fmt: skip
        if self.terms.ranks is not None:  # sized for the widest rank; the whole map, with its ranks
            return self.terms.ranks.spread(plan, what)
        plan.head_map = self._with_patterns(plan.head_map)  # retrieval heads keep all
        return plan

    def empty(self) -> Plan | None:
        """The all-resident layout of the lane's part for no sequence yet: the pools a new
        part starts with (None where the part holds not even the scratch page)."""
        full = self.terms.spec.full_page_bytes
        if self.memory.region < full:
            return None
        head_map = HeadMap.all_gpu(self.terms.spec.num_layers, self.terms.spec.num_kv_heads)
        return Plan(head_map, "none", self.memory.region // full - 1, 0, None, 0)

    def fits(self, seqs: list[Sequence]) -> bool:
        """Whether some plan holds ``seqs`` together."""
        try:
            self.plan(seqs)
        except UserError:
            return False
        return True

    def _with_patterns(self, head_map: HeadMap) -> HeadMap:
        """The profile's retrieval heads keep every token; the others take the pattern
        (where asked)."""
        retrieval = None if self.terms.profile is None else self.terms.profile.retrieval
        return self.terms.config.with_patterns(head_map, retrieval)

    def _entry_plan(self, seqs: list[Sequence], what: str) -> Plan:
        """Per-entry pages (budgets, streaming heads): patterns and budgets first, then
        which entries live in host pages if the batch does not fit (never a ring)."""
        config, spec, budget = self.terms.config, self.terms.spec, self.budget
        head_map = self._with_patterns(HeadMap.all_gpu(spec.num_layers, spec.num_kv_heads))
        kept = None if budget is None else max(budget.tokens(len(s.prompt_ids)) for s in seqs)
        parts = None
        if self.terms.ranks is not None:  # the whole map, with its ranks; each rank's entries
            head_map, parts = self.terms.ranks.head_map, self.terms.ranks.entry_parts()
        head_map = with_budgets(head_map, kept)  # rings keep their sink and window
        return plan_entries(spec, self.memory.region, head_map, [s.max_tokens for s in seqs],
                            self.bounds(seqs), offload=config.offload.mode,
                            host_budget=self.memory.host_bytes, what=what, parts=parts,
                            ring_chunk=self.terms.chunk if budget is None else None)  # fmt: skip

    def bounds(self, seqs: list[Sequence]) -> list[int]:
        """Most tokens one entry of each sequence holds after its prompt."""
        if self.budget is None:
            return [s.max_tokens for s in seqs]
        return [self.budget.most_held(len(s.prompt_ids), s.max_tokens) for s in seqs]

    def rate(self, plan: Plan, seqs: list[Sequence]) -> float:
        """Predicted sequences x tokens/s of a decode step over ``seqs`` (roofline; with
        entries in host pages, over what each holds after its prompt)."""
        terms = self.terms
        if plan.entry_staging:  # under torchrun: the slowest rank's step
            counts = [(plan.head_map.count("gpu"), plan.head_map.num_offloaded)]
            if terms.ranks is not None:
                counts = terms.ranks.entry_counts(plan.head_map)
            seconds = max(entry_step_seconds(terms.spec, resident, offloaded, self.bounds(seqs),
                                             terms.weight_bytes, terms.hardware,
                                             terms.streamed_bytes)
                          for resident, offloaded in counts)  # fmt: skip
        else:
            if plan.rank_map is not None:  # under torchrun: the widest rank's step
                plan = replace(plan, head_map=plan.rank_map)
            share = terms.config.offload_plan_options()["cpu_share"]
            seconds, _ = step_seconds(terms.model_config, plan, sum(s.max_tokens for s in seqs),
                                      terms.spec.dtype_bytes, terms.hardware, share,
                                      streamed_weights=terms.streamed_bytes)  # fmt: skip
        return len(seqs) / seconds

    def choose(self, queue: list[Sequence]) -> tuple[Plan, set[int] | None]:
        """The layout for the sequences next in line: all resident if the first fits, else
        the streaming plan for the first k that maximises the predicted throughput; and,
        with entries in host pages (whose staging slots hold what was planned, no more),
        the sequences it was made for (None: any may join). UserError when even the first
        has no plan."""
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
        return best, ({s.seq_id for s in planned} if best.entry_staging else None)

    def joins(self, plan: Plan, running: list[Sequence], seq: Sequence) -> bool:
        """While heads stream, whether ``seq`` joins ``running`` under ``plan``: only if the
        predicted throughput does not drop (every byte of its history crosses PCIe each
        step)."""
        if plan.staging is None or not running:
            return True
        return self.rate(plan, running + [seq]) >= self.rate(plan, running)


__all__ = ["LaneMemory", "LayoutPlanner", "PlanTerms"]

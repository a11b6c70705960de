"""Engine options, in documented groups: how the model runs (:class:`RuntimeConfig`), the
memory budgets and KV pages (:class:`CacheConfig`), the host tier (:class:`OffloadConfig`),
per-head budgets and patterns (:class:`BudgetConfig`) and the spread over GPUs
(:class:`ParallelConfig`). Users give their fields as flat keywords (``LLM(offload=...)``,
:meth:`EngineConfig.of`) and the command lines derive one flag per field from them, in
one help section per group; a field's choices are its ``Literal`` type."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import ClassVar, get_args

from headspace.budgets.spec import POOL, KVBudget, PolicyName
from headspace.engine.config_fields import (
    _is_number,
    _option,
    _positive_ints,
    check_choices,
    flat_name,
)
from headspace.engine.config_runtime import RuntimeConfig
from headspace.errors import UserError
from headspace.kv.spec import Pattern
from headspace.parallel.config import ENGINE_FIELDS, ParallelConfig
from headspace.planner.entry_offload import check_offload
from headspace.planner.memory import WeightMode
from headspace.planner.plan import OffloadMode
from headspace.planner.profile import with_patterns
from headspace.tiers.settings import HybridSettings

KV_POLICIES = get_args(PolicyName)


@dataclass
class CacheConfig:
    """Memory budgets, the KV page pools and where the weights live."""

    SECTION: ClassVar[str] = "memory and tiers"
    gpu_memory: str | float | None = _option(
        None, "GPU memory budget, e.g. 24GiB, 500MB or a fraction such as 0.8 (default: most "
        "of what is free); weights, activations and KV pages stay within it"
    )  # fmt: skip
    host_memory: str | float | None = _option(
        None, "host memory budget for KV pages (default: 90% of the RAM available; under "
        "torchrun the ranks on a machine divide it)"
    )  # fmt: skip
    num_kv_pages: int | None = _option(
        None, "pages of the all-resident KV pool (overrides the budget)"
    )
    page_size: int = _option(128, "tokens per KV page")
    prefix_caching: bool = _option(True, "reuse the KV pages of prompt prefixes seen before")
    resident_reserve: float = _option(
        0.25, "share of the KV arena kept for all-resident requests while a long one streams "
        "heads beside them (requests arriving one by one, as a server's: short ones arriving "
        "after a long one start at once; 0: the long one takes all the others leave)"
    )  # fmt: skip
    weights: WeightMode = _option(
        "auto", "where decoder layers' weights live: gpu (resident), stream (pinned host "
        "memory, each layer copied to the GPU while the one before computes; no CUDA graphs), "
        "auto (stream only when resident weights leave no room for KV in the GPU budget)"
    )  # fmt: skip

    def __post_init__(self):
        check_choices(self)
        _positive_ints(self, ("page_size",), optional=False)
        _positive_ints(self, ("num_kv_pages",), optional=True)
        reserve = self.resident_reserve
        if isinstance(reserve, bool) or not isinstance(reserve, int | float) or \
                not 0 <= reserve < 1:  # fmt: skip
            raise UserError(f"resident_reserve must be in [0, 1), got {reserve!r}")


@dataclass
class OffloadConfig:
    """The host tier: which heads leave the GPU and how their attention runs."""

    SECTION: ClassVar[str] = "memory and tiers"
    mode: OffloadMode = _option(
        "auto", "host tier: auto (stream kv heads from host pages, and swap sequences out, "
        "only when the running batch needs it), none (never), layer (stream whole layers), "
        "head (stream head groups), hybrid (offloaded heads' older tokens attended by CPU "
        "threads in host memory, merged exactly)", flag="offload"
    )  # fmt: skip
    head_group: int | None = _option(None, "kv heads per streamed group (default: the planner's)")
    cpu_share: float | None = _option(
        None, "hybrid: share of each offloaded history (before the GPU window) attended by "
        "CPU threads, the rest streamed over PCIe (default: searched from the decode steps' "
        "times, from the planner's rates' balance, 0.5; 1 = CPU only)"
    )  # fmt: skip
    gpu_window: int = _option(1024, "hybrid: most recent tokens always attended on the GPU")
    window_on_gpu: bool = _option(
        True, "hybrid: keep each offloaded head's GPU window in GPU pages, so that a step "
        "sends only the query and the CPU's result over PCIe (off: stage it from host pages "
        "every step)"
    )  # fmt: skip
    cpu_sparsity: float | None = _option(
        None, "hybrid: HGCA's beta; CPU threads attend only the older tokens whose moving "
        "average of attention weights exceeds beta / n, per (layer, kv head) (default: every "
        "token, exact; needs offload hybrid, where the CPU then takes all before the window)"
    )  # fmt: skip
    maw_alpha: float = _option(
        0.1, "hybrid sparse: weight of each step in the moving average of attention weights "
        "of the tokens in the GPU window"
    )  # fmt: skip
    cpu_query_blocks: int = _option(
        64, "hybrid sparse: blocks of 16 tokens each (sequence, kv head) also attends every "
        "step, those whose keys could weigh most for the step's own query (Quest's bound "
        "over each block's key box; 0: the tokens the moving averages keep, alone)"
    )  # fmt: skip
    cpu_threads: int | None = _option(
        None, "hybrid: CPU threads of the attention kernel (default: the cores less one)"
    )

    def __post_init__(self):
        check_choices(self)
        _positive_ints(self, ("gpu_window",), optional=False)
        _positive_ints(self, ("head_group", "cpu_threads"), optional=True)
        blocks = self.cpu_query_blocks
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 0:
            raise UserError(f"cpu_query_blocks must be an integer >= 0, got {blocks!r}")
        share, beta, alpha = self.cpu_share, self.cpu_sparsity, self.maw_alpha
        if share is not None and (not _is_number(share) or not 0 <= share <= 1):
            raise UserError(f"cpu_share must be between 0 and 1, got {share}")
        if beta is not None and (not _is_number(beta) or beta < 0):
            raise UserError(f"cpu_sparsity must be a number >= 0, got {beta}")
        if not _is_number(alpha) or not 0 < alpha <= 1:
            raise UserError(f"maw_alpha must be in (0, 1], got {alpha}")
        if beta is not None and self.mode != "hybrid":
            raise UserError(f"cpu_sparsity needs offload 'hybrid', got {self.mode!r}")
        if beta is not None and share not in (None, 1):
            raise UserError(f"cpu_sparsity attends all before the GPU window on the CPU; "
                            f"cpu_share must be 1 or unset, got {share}")  # fmt: skip

    @property
    def hybrid_cpu_share(self) -> float | None:
        """The hybrid tier's CPU share as asked: 1 in sparse mode (the CPU takes all before
        the window), else ``cpu_share`` (None: searched at run time, from the balance of
        the planner's rates)."""
        return 1.0 if self.cpu_sparsity is not None else self.cpu_share


@dataclass
class BudgetConfig:
    """Approximate modes: per-head KV budgets and prompt attention patterns."""

    SECTION: ClassVar[str] = "budgets and patterns"
    kv_budget: float | int | None = _option(
        None, "KV kept per (layer, kv head) after the prompt, in per-head pages: a fraction "
        "of the prompt in (0, 1] (0.25), or a token count (API: an int; flag: 2048tok), at "
        "least the policy's 32-token observation window (default: everything, exact)"
    )  # fmt: skip
    kv_policy: PolicyName = _option(
        "snapkv", "with kv_budget: which tokens and how many per head (snapkv: the same "
        "count, ada_snapkv: a layer's heads share by score, headkv: by a profile's scores)"
    )  # fmt: skip
    kv_pool: int = _option(
        POOL, "with kv_budget: odd width of the max-pool that spreads each token's score to "
        "its neighbours, so a head keeps the tokens around what the prompt's last queries "
        "attend"
    )  # fmt: skip
    profile: str | None = _option(
        None, "a profile from `headspace profile` (headkv's scores, retrieval heads)"
    )
    retrieval_heads: float | None = _option(
        None, "with a profile: share of (layer, kv head) entries, by retrieval score, that "
        "keep every token; the others take sparse_pattern (default: all keep every token)"
    )  # fmt: skip
    sparse_pattern: str = _option(
        "streaming(4,1024)", "with retrieval_heads: the other entries' pattern, applied to "
        "the prompt: streaming(sink,window) (such a head also holds only its sink and window "
        "tokens at decode), vertical_slash(columns,diagonals) or block_sparse(blocks) (each "
        "chunk's pattern estimated from its queries; decode attends every token)"
    )  # fmt: skip

    def __post_init__(self):
        check_choices(self)
        self._check_budget()
        share = self.retrieval_heads
        if share is not None and (not _is_number(share) or not 0 <= share <= 1):
            raise UserError(f"retrieval_heads must be a share in [0, 1], got {share}")
        if share is not None and self.profile is None:
            raise UserError("retrieval_heads ranks heads by a profile's retrieval scores: "
                            "give --profile (from `headspace profile`)")  # fmt: skip
        try:
            pattern = Pattern.parse(self.sparse_pattern)
        except ValueError as error:
            raise UserError(f"sparse_pattern: {error}") from None
        if pattern.is_full:
            raise UserError("sparse_pattern must be sparse: streaming(sink,window), "
                            "vertical_slash(columns,slashes) or block_sparse(blocks)")  # fmt: skip
        self._streaming = pattern.kind == "streaming"  # read by per_head_pages, every step

    def _check_budget(self) -> None:
        value = self.kv_budget
        try:  # a token count given as a float (CLI) becomes an int; the pool checked always
            budget = KVBudget(1.0 if value is None else value, self.kv_policy, pool=self.kv_pool)
        except ValueError as error:
            raise UserError(str(error)) from None
        if value is None:
            return
        self.kv_budget = budget.value
        if self.kv_policy == "headkv" and self.profile is None:
            raise UserError("kv_policy headkv divides the budget by a profile's scores: "
                            "give --profile (from `headspace profile`)")  # fmt: skip

    @property
    def per_head_pages(self) -> bool:
        """Whether each (layer, kv head) entry has its own pages (budgets, streaming heads;
        prefill-only patterns keep the shared pages)."""
        return self.kv_budget is not None or (self.retrieval_heads is not None and self._streaming)


GROUPS = {"runtime": RuntimeConfig, "cache": CacheConfig, "offload": OffloadConfig,
          "budgets": BudgetConfig}  # fmt: skip


@dataclass
class EngineConfig:
    """How the engine runs a model, one documented group per concern."""

    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    budgets: BudgetConfig = field(default_factory=BudgetConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # under torchrun: how
    # kv heads are spread over the ranks (``gpus`` is the world size there)

    def __post_init__(self):
        for name, kind in {**GROUPS, "parallel": ParallelConfig}.items():
            if not isinstance(getattr(self, name), kind):
                raise UserError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        if self.budgets.per_head_pages:
            check_offload(self.offload.mode)

    def shares_gpu(self, streamed: bool, ranked: bool) -> bool:
        """Whether a resident lane and an offload lane run side by side (``engine.lanes``):
        in one process (not ``ranked``), with resident weights (not ``streamed``), shared
        pages and a host tier."""
        return not (streamed or ranked or self.budgets.per_head_pages
                    or self.offload.mode == "none")  # fmt: skip

    @property
    def swaps(self) -> bool:
        """Whether a sequence may be swapped out to host pages in the all-resident layout
        (a host tier, shared pages)."""
        return self.offload.mode != "none" and not self.budgets.per_head_pages

    def entry_budget(self) -> KVBudget | None:
        """What each (layer, kv head) keeps of a prompt (None: everything, exact)."""
        budgets = self.budgets
        if budgets.kv_budget is None:
            return None
        return KVBudget(budgets.kv_budget, budgets.kv_policy, pool=budgets.kv_pool)

    def hybrid_settings(self) -> HybridSettings:
        """The hybrid tier's CPU side as these options set it."""
        offload = self.offload
        return HybridSettings(offload.cpu_threads, offload.cpu_sparsity, offload.maw_alpha,
                              offload.gpu_window, offload.cpu_query_blocks)  # fmt: skip

    def offload_plan_options(self) -> dict:
        """The planner's keywords of the host tier (``plan_batch``'s): its mode, head group,
        the hybrid tier's CPU share and GPU window."""
        offload = self.offload
        return {"offload": offload.mode, "head_group": offload.head_group,
                "cpu_share": offload.hybrid_cpu_share, "gpu_window": offload.gpu_window,
                "window_on_gpu": offload.window_on_gpu}  # fmt: skip

    @property
    def searches_share(self) -> bool:
        """Whether the hybrid tier's CPU share is searched from the steps' times (not asked
        for)."""
        return self.offload.hybrid_cpu_share is None

    def with_patterns(self, head_map, retrieval):
        """``head_map`` with the profile's retrieval heads (``retrieval [layers][kv heads]``
        scores) keeping every token and the others the sparse pattern, where asked (else
        as it is)."""
        budgets = self.budgets
        if budgets.retrieval_heads is None:
            return head_map
        return with_patterns(head_map, retrieval, budgets.retrieval_heads, budgets.sparse_pattern)

    def prompt_gathers(self) -> tuple[bool, str | None] | None:
        """What a layer's prefill gathers beside the arena: None (nothing), else (whether
        KV budgets score the prompt, the pattern of the non-retrieval heads or None)."""
        budgets = self.budgets
        if not budgets.per_head_pages and budgets.retrieval_heads is None:
            return None
        pattern = None if budgets.retrieval_heads is None else budgets.sparse_pattern
        return budgets.kv_budget is not None, pattern

    def host_kv_bytes(self, host_bytes: int, box_bytes_per_kv_byte: float) -> int:
        """Of ``host_bytes``, what KV pages may take: the sparse hybrid mode's key boxes
        (``box_bytes_per_kv_byte`` of them a KV byte) take the rest."""
        if self.offload.cpu_sparsity is None or not self.offload.cpu_query_blocks:
            return host_bytes
        return int(host_bytes / (1 + box_bytes_per_kv_byte))

    def entries_per_page(self, spec, layout=None) -> int | None:
        """The (layer, kv head) entries of one page pool where each entry has its own pages
        (``layout``: one rank's heads), else None: a page holds every entry."""
        if not self.budgets.per_head_pages:
            return None
        return spec.num_entries if layout is None else sum(layout.layer_heads)

    @classmethod
    def of(cls, **options) -> EngineConfig:
        """From the API's flat keywords: each names one group's field (``offload`` the
        host tier's mode; ``balance``, ``replicas``, ``balance_phase``, ``copy_seconds``,
        ``balance_batch`` the spread over GPUs). UserError for a name no group has."""
        where = flat_fields()
        unknown = set(options) - set(where) - set(ENGINE_FIELDS)
        if unknown:
            raise UserError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        grouped: dict[str, dict] = {name: {} for name in GROUPS}
        for flag, value in options.items():
            if flag in where:
                group, name = where[flag]
                grouped[group][name] = value
        parallel = {k: options[k] for k in ENGINE_FIELDS if k in options}
        made = {group: GROUPS[group](**values) for group, values in grouped.items()}
        return cls(**made, parallel=ParallelConfig(**parallel))

    def on(self, device: str) -> EngineConfig:
        """The same options on another device."""
        return replace(self, runtime=replace(self.runtime, device=device))


def flat_fields() -> dict[str, tuple[str, str]]:
    """Each flat keyword (and flag) of the engine's groups: (group, field name)."""
    return {flat_name(f): (group, f.name) for group, kind in GROUPS.items()
            for f in fields(kind)}  # fmt: skip

"""Engine options: one documented dataclass; the API takes its fields as keyword arguments
and every command line that runs the engine derives its flags from them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from headspace.budgets import POLICIES, POOL, KVBudget
from headspace.errors import UserError
from headspace.kv.spec import Pattern
from headspace.parallel.config import ParallelConfig
from headspace.planner.entry_offload import check_offload
from headspace.planner.memory import WEIGHT_MODES
from headspace.planner.plan import OFFLOAD_MODES

KV_POLICIES = tuple(POLICIES)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


RUNTIME, MEMORY, BUDGETS = "runtime", "memory and tiers", "budgets and patterns"
# a step's prompt work beside decoding requests, by default: small while requests arrive one
# by one (their time per output token stays within a few times its usual value), large for
# a batch given at once (fewer, fuller steps), as vLLM sizes its token budget by usage
ARRIVING_STEP_TOKENS, AT_ONCE_STEP_TOKENS = 512, 8192


def _option(default, help: str, *, group: str = RUNTIME, choices=None, cli_default=None):
    """A documented field: ``help`` is its flag's help text, ``group`` its section of the
    help; ``cli_default`` the command line's default when it differs from the API's."""
    meta = {"help": help, "group": group, "choices": choices, "cli_default": cli_default}
    return field(default=default, metadata={k: v for k, v in meta.items() if v is not None})


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class EngineConfig:
    """How the engine runs a model (each field is also a command-line flag)."""

    device: str = _option("cpu", "cpu or cuda[:N]")
    dtype: str | None = _option(
        None, "weights and KV dtype (default: float32 on CPU, bfloat16 on GPU)",
        choices=tuple(DTYPES),
    )  # fmt: skip
    prefill_chunk: int | None = _option(
        None, "prompt tokens per prefill step (default: what the budget allows)"
    )
    prefill_step_tokens: int | None = _option(
        None, "while other requests decode: a step carries at most the work of a prompt's "
        "first this many tokens through every layer (a resident chunk runs a few layers a "
        "step, other layouts shorter pieces; with none decoding, a whole chunk a step). "
        f"Default: {ARRIVING_STEP_TOKENS} for requests added one by one (a server: the "
        f"others' tokens keep their pace), {AT_ONCE_STEP_TOKENS} for a batch given at once "
        "(generate: throughput first)",
    )  # fmt: skip
    max_context: int | None = _option(
        None, "longest sequence allowed (default: the model's trained context)"
    )
    attention_backend: str = _option(
        "sdpa", "attention kernels: fused (sdpa) or the fp32 reference",
        choices=("sdpa", "reference"),
    )  # fmt: skip
    cuda_graph: bool = _option(True, "capture the decode step in CUDA graphs (GPU)")
    compile: bool = _option(True, "fuse each layer's elementwise work with torch.compile (GPU)")
    weights: str = _option(
        "auto", "where decoder layers' weights live: gpu (resident), stream (pinned host "
        "memory, each layer copied to the GPU while the one before computes; no CUDA graphs), "
        "auto (stream only when resident weights leave no room for KV in the GPU budget)",
        choices=WEIGHT_MODES, group=MEMORY
    )  # fmt: skip
    progress: bool = _option(False, "progress bars on long prefills", cli_default=True)
    gpu_memory: str | float | None = _option(
        None, "GPU memory budget, e.g. 24GiB, 500MB or a fraction such as 0.8 (default: most "
        "of what is free); weights, activations and KV pages stay within it", group=MEMORY
    )  # fmt: skip
    num_kv_pages: int | None = _option(
        None, "pages of the all-resident KV pool (overrides the budget)", group=MEMORY
    )
    page_size: int = _option(128, "tokens per KV page", group=MEMORY)
    max_batch: int = _option(64, "most sequences decoded together")
    prefix_caching: bool = _option(
        True, "reuse the KV pages of prompt prefixes seen before", group=MEMORY
    )
    offload: str = _option(
        "auto", "host tier: auto (stream kv heads from host pages, and swap sequences out, "
        "only when the running batch needs it), none (never), layer (stream whole layers), "
        "head (stream head groups), hybrid (offloaded heads' older tokens attended by CPU "
        "threads in host memory, merged exactly)", choices=OFFLOAD_MODES, group=MEMORY
    )  # fmt: skip
    cpu_share: float | None = _option(
        None, "hybrid: share of each offloaded history (before the GPU window) attended by "
        "CPU threads, the rest streamed over PCIe (default: split by the CPU and PCIe rates; "
        "1 = CPU only)", group=MEMORY
    )  # fmt: skip
    gpu_window: int = _option(
        1024, "hybrid: most recent tokens always attended on the GPU", group=MEMORY
    )
    cpu_sparsity: float | None = _option(
        None, "hybrid: HGCA's beta; CPU threads attend only the older tokens whose moving "
        "average of attention weights exceeds beta / n, per (layer, kv head) (default: every "
        "token, exact; needs offload hybrid, where the CPU then takes all before the window)",
        group=MEMORY,
    )  # fmt: skip
    maw_alpha: float = _option(
        0.1,
        "hybrid sparse: weight of each step in the moving average of attention weights",
        group=MEMORY,
    )
    cpu_threads: int | None = _option(
        None,
        "hybrid: CPU threads of the attention kernel (default: the cores less one)",
        group=MEMORY,
    )
    head_group: int | None = _option(
        None, "kv heads per streamed group (default: the planner's)", group=MEMORY
    )
    host_memory: str | float | None = _option(
        None,
        "host memory budget for KV pages (default: 90% of the RAM available; under "
        "torchrun the ranks on a machine divide it)",
        group=MEMORY,
    )
    kv_budget: float | int | None = _option(
        None, "KV kept per (layer, kv head) after the prompt, in per-head pages: a fraction "
        "of the prompt in (0, 1] (0.25), or a token count (API: an int; flag: 2048tok), at "
        "least the policy's 32-token observation window (default: everything, exact)",
        group=BUDGETS,
    )  # fmt: skip
    kv_policy: str = _option(
        "snapkv", "with kv_budget: which tokens and how many per head (snapkv: the same "
        "count, ada_snapkv: a layer's heads share by score, headkv: by a profile's scores)",
        choices=KV_POLICIES, group=BUDGETS
    )  # fmt: skip
    kv_pool: int = _option(
        POOL, "with kv_budget: odd width of the max-pool that spreads each token's score to "
        "its neighbours, so a head keeps the tokens around what the prompt's last queries "
        "attend", group=BUDGETS
    )  # fmt: skip
    profile: str | None = _option(
        None, "a profile from `headspace profile` (headkv's scores, retrieval heads)", group=BUDGETS
    )
    retrieval_heads: float | None = _option(
        None, "with a profile: share of (layer, kv head) entries, by retrieval score, that "
        "keep every token; the others take sparse_pattern (default: all keep every token)",
        group=BUDGETS,
    )  # fmt: skip
    sparse_pattern: str = _option(
        "streaming(4,1024)", "with retrieval_heads: the other entries' pattern, applied to "
        "the prompt: streaming(sink,window) (such a head also holds only its sink and window "
        "tokens at decode), vertical_slash(columns,diagonals) or block_sparse(blocks) (each "
        "chunk's pattern estimated from its queries; decode attends every token)", group=BUDGETS
    )  # fmt: skip
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # under torchrun: how
    # kv heads are spread over the ranks (its own flags; ``gpus`` is the world size)

    def __post_init__(self):
        if not isinstance(self.parallel, ParallelConfig):
            raise UserError(f"parallel must be a ParallelConfig, got {self.parallel!r}")
        if self.dtype is None:
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.dtype not in DTYPES:
            raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise UserError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"device {self.device!r} requested but no CUDA GPU is available")
        for name in ("prefill_chunk", "max_context", "head_group", "num_kv_pages", "cpu_threads",
                     "prefill_step_tokens"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise UserError(f"{name} must be a positive integer, got {value}")
        share = self.cpu_share
        if share is not None and (not _is_number(share) or not 0 <= share <= 1):
            raise UserError(f"cpu_share must be between 0 and 1, got {self.cpu_share}")
        self._check_sparsity()
        self._check_patterns()
        self._check_budget()
        for name in ("page_size", "max_batch", "gpu_window"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UserError(f"{name} must be a positive integer, got {value}")
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise UserError(
                    f"{f.name} must be one of {', '.join(choices)}, got {getattr(self, f.name)!r}"
                )

    def _check_sparsity(self) -> None:
        beta, alpha = self.cpu_sparsity, self.maw_alpha
        if beta is not None and (not _is_number(beta) or beta < 0):
            raise UserError(f"cpu_sparsity must be a number >= 0, got {beta}")
        if not _is_number(alpha) or not 0 < alpha <= 1:
            raise UserError(f"maw_alpha must be in (0, 1], got {alpha}")
        if beta is not None and self.offload != "hybrid":
            raise UserError(f"cpu_sparsity needs offload 'hybrid', got {self.offload!r}")
        if beta is not None and self.cpu_share not in (None, 1):
            raise UserError(f"cpu_sparsity attends all before the GPU window on the CPU; "
                            f"cpu_share must be 1 or unset, got {self.cpu_share}")  # fmt: skip

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

    def _check_patterns(self) -> None:
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
        self._streaming = pattern.kind == "streaming"  # read by per_head_pages, every step
        if pattern.is_full:
            raise UserError("sparse_pattern must be sparse: streaming(sink,window), "
                            "vertical_slash(columns,slashes) or block_sparse(blocks)")  # fmt: skip
        if self.per_head_pages:
            check_offload(self.offload)

    @property
    def per_head_pages(self) -> bool:
        """Whether each (layer, kv head) entry has its own pages (budgets, streaming heads;
        prefill-only patterns keep the shared pages)."""
        return self.kv_budget is not None or (self.retrieval_heads is not None and self._streaming)

    @property
    def hybrid_cpu_share(self) -> float | None:
        """The hybrid tier's CPU share as asked: 1 in sparse mode (the CPU takes all before
        the window), else ``cpu_share`` (None: the balance of the planner's rates)."""
        return 1.0 if self.cpu_sparsity is not None else self.cpu_share

    def step_tokens(self, at_once: bool) -> int:
        """``prefill_step_tokens`` as asked, else its default for requests given at once
        (``at_once``) or added one by one."""
        if self.prefill_step_tokens is not None:
            return self.prefill_step_tokens
        return AT_ONCE_STEP_TOKENS if at_once else ARRIVING_STEP_TOKENS

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

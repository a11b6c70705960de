"""How the model runs (:class:`RuntimeConfig`): device, dtype, kernels, batch and the prefill
pieces beside decoding requests; one of the engine's option groups
(:mod:`headspace.engine.config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from headspace.engine.config_fields import (
    ARRIVING_STEP_TOKENS,
    AT_ONCE_STEP_TOKENS,
    MIXED_SLOWDOWN,
    ORDER_PASSES,
    PREFILL_SLOWDOWN,
    PREFILL_SM_SHARE,
    _option,
    _positive_ints,
    check_choices,
)
from headspace.errors import UserError

if TYPE_CHECKING:  # (torch is imported where it is used: the CLI's flags and help need none)
    import torch

DType = Literal["float32", "bfloat16", "float16"]  # (torch's names of the dtypes)


@dataclass
class RuntimeConfig:
    """How the model runs: device, kernels, batch and prefill pieces."""

    SECTION: ClassVar[str] = "runtime"
    device: str = _option("cpu", "cpu or cuda[:N]")
    dtype: DType | None = _option(
        None, "weights and KV dtype (default: float32 on CPU, bfloat16 on GPU)"
    )
    attention_backend: Literal["sdpa", "flex", "reference"] = _option(
        "sdpa", "attention kernels: fused (sdpa: cuDNN prefill over gathered pages, Triton "
        "decode), FlexAttention over the pages in place (flex; no CUDA graphs), or the fp32 "
        "reference"
    )  # fmt: skip
    cuda_graph: bool = _option(True, "capture the decode step in CUDA graphs (GPU)")
    compile: bool = _option(True, "fuse each layer's elementwise work with torch.compile (GPU)")
    tune_decode: bool = _option(
        False, "the CUDA-graphed decode step's blocks compiled per batch bucket with "
        "Inductor's max-autotune (GPU: about 40 s a bucket on a fresh machine, and no faster "
        "step on an H100); else compiled once for every batch past one row and once for one "
        "row, with Inductor's defaults"
    )  # fmt: skip
    progress: bool = _option(False, "progress bars on long prefills", cli_default=True)
    max_batch: int = _option(64, "most sequences decoded together")
    max_context: int | None = _option(
        None, "longest sequence allowed (default: the model's trained context)"
    )
    prompt_order: Literal["shortest", "arrival"] = _option(
        "shortest", "of requests arriving one by one (a server), which waiting prompt is "
        "admitted next: each in its turn of arrival, or the shortest (a burst's first tokens "
        f"sooner on the whole), though none is passed over by more than {ORDER_PASSES} later "
        "ones. A batch given at once runs in the order given",
    )  # fmt: skip
    prefill_chunk: int | None = _option(
        None, "prompt tokens per prefill step (default: what the budget allows)"
    )
    prefill_step_tokens: int | None = _option(
        None, "while other requests decode: a step carries at most the work of a prompt's "
        "first this many tokens through every layer (where the layout allows, a chunk runs "
        "a few layers a step; elsewhere a piece is this many tokens; with none decoding, a "
        f"whole chunk a step). Default: {ARRIVING_STEP_TOKENS} for requests added one by one "
        "where a chunk runs in layer slices (a server: the others' tokens keep their pace), "
        f"else {AT_ONCE_STEP_TOKENS} (a batch given at once, generate: throughput first; "
        "pieces of other layouts: each re-reads the prompt's prefix)",
    )  # fmt: skip
    prefill_slowdown: float | None = _option(
        None, "while other prompts wait their turn, a step carries more prompt work beside "
        "decoding requests: up to this many times their decode step alone (the cap on their "
        "time per token then), never less than prefill_step_tokens; 1: no more. Where the "
        "piece rides in their forward (mixed_steps) for requests arriving one by one, the "
        "piece is this cap's whether prompts wait or not (prefill_step_tokens its floor only "
        f"where given). Default: {MIXED_SLOWDOWN} there, else {PREFILL_SLOWDOWN}",
    )  # fmt: skip
    mixed_steps: bool = _option(
        False, "beside decoding requests, a prompt's piece and their decode rows run through "
        "the layers in one forward (the weights read once: vLLM's chunked-prefill batch) "
        "where every tier of the layout allows it (all resident), captured in CUDA graphs "
        "as the decode step is (the piece's lengths read on the device); else two forwards "
        "a step, the decode step's in a CUDA graph",
    )  # fmt: skip
    prefill_key_span: int | None = _option(
        None, "a prompt piece's attention over its prefix reads at most this many keys a "
        "kernel (runs merged by log-sum-exp: shorter thread blocks, which the decode steps "
        "of requests beside it wait for less; not under the flex backend or per-head "
        "patterns); default: no bound",
    )  # fmt: skip
    prefill_sm_share: float = _option(
        PREFILL_SM_SHARE, "beside decoding requests on a GPU, the share of its SMs that a long "
        "prompt's pieces in the offload lane run on (a CUDA green context), the rest kept for "
        "the others' decode steps: their time per token evener, theirs and the long prompt's "
        "slower (0.85 on an H100: p99 2.6x alone instead of 5.7x, p50 1.42x, the long first "
        "token 1.46x); default 1: all of them",
    )  # fmt: skip

    def __post_init__(self):
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise UserError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.on_gpu and not _cuda_available():
            raise UserError(f"device {self.device!r} requested but no CUDA GPU is available")
        if self.dtype is None:
            self.dtype = "bfloat16" if self.on_gpu else "float32"
        check_choices(self)
        _positive_ints(self, ("max_batch",), optional=False)
        _positive_ints(self, ("max_context", "prefill_chunk", "prefill_step_tokens",
                              "prefill_key_span"), True)  # fmt: skip
        if self.prefill_slowdown is not None and not self.prefill_slowdown >= 1:  # (NaN too)
            raise UserError(f"prefill_slowdown must be at least 1, got {self.prefill_slowdown}")
        if not 0 < self.prefill_sm_share <= 1:
            raise UserError(f"prefill_sm_share must be in (0, 1], got {self.prefill_sm_share}")

    def step_tokens(self, at_once: bool, slices: bool = True) -> int:
        """``prefill_step_tokens`` as asked, else its default for requests given at once
        (``at_once``) or added one by one, in a layout where a chunk runs in layer slices
        (``slices``) or one where a piece runs through every layer."""
        if self.prefill_step_tokens is not None:
            return self.prefill_step_tokens
        return ARRIVING_STEP_TOKENS if slices and not at_once else AT_ONCE_STEP_TOKENS

    def slowdown(self, mixed: bool) -> float:
        """``prefill_slowdown`` as asked, else its default where a piece rides in the decode
        rows' forward (``mixed``) or runs as a forward of its own."""
        if self.prefill_slowdown is not None:
            return self.prefill_slowdown
        return MIXED_SLOWDOWN if mixed else PREFILL_SLOWDOWN

    @property
    def passes(self) -> int:
        """How many later prompts may be admitted before a waiting one (0: arrival order)."""
        return ORDER_PASSES if self.prompt_order == "shortest" else 0

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


__all__ = ["DType", "RuntimeConfig"]

"""What a request gets back: its text, tokens, and how it ran."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from headspace.planner.plan import Plan


# why a request ended, in detail (GenerationStats.ended) -> its finish reason, as the API says
FINISH_REASONS = {
    "end of sequence": "stop", "stop token": "stop", "stop string": "stop",
    "max_new_tokens": "length", "context": "length",
    "aborted": "abort", "interrupted": "abort", "non-finite logits": "error",
    "no pages": "error",  # none free on the GPU, and no host page to swap out to or grow into
}  # fmt: skip


@dataclass
class GenerationStats:
    """Counts and timings of one request (seconds, bytes), and the tiers it ran on."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    # why it ended, in detail (FINISH_REASONS' keys); the summary shows its finish reason
    # first
    ended: str | None = None
    num_gpu_heads: int = 0  # (layer, kv head) entries resident while it ran
    num_streamed_heads: int = 0  # entries streamed from host pages
    num_hybrid_heads: int = 0  # offloaded entries whose older tokens the CPU attends
    cpu_share: float | None = None  # ... the share of their history before the GPU window
    num_swaps: int = 0  # times it was swapped out to host pages and back
    lane: str | None = None  # the lane it ran in ("resident", "offload", "main")
    # sparse hybrid: (min, median, max) share of the CPU-side tokens kept per hybrid head
    cpu_kept_fraction: tuple[float, float, float] | None = None
    # KV budgets: K/V bytes the request held at its end, and their share of its full KV
    kv_held_bytes: int | None = None
    kv_held_fraction: float | None = None
    peak_gpu_bytes: int | None = None  # allocated by tensors
    peak_reserved_bytes: int | None = None  # reserved by torch's caching allocator

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tok_s(self) -> float:
        return max(self.generated_tokens - 1, 0) / max(self.decode_seconds, 1e-9)

    def summary(self) -> str:
        parts = [
            f"prompt {self.prompt_tokens} tokens",
            f"prefill {self.prefill_tok_s:,.0f} tok/s",
            f"decode {self.decode_tok_s:,.1f} tok/s ({self.generated_tokens} tokens)",
            f"heads {self.num_gpu_heads} resident / {self.num_streamed_heads} streamed",
        ]
        if self.num_hybrid_heads:
            parts[-1] = f"heads {self.num_gpu_heads} resident / {self.num_hybrid_heads} hybrid"
            if self.cpu_share is not None:
                parts[-1] += f" (CPU share {self.cpu_share:.2f})"
        if self.cpu_kept_fraction is not None:
            low, median, high = self.cpu_kept_fraction
            parts.append(f"CPU kept {median:.1%} median ({low:.1%}-{high:.1%})")
        if self.kv_held_fraction is not None:
            parts.append(f"KV held {self.kv_held_bytes / 2**20:.1f} MiB "
                         f"({self.kv_held_fraction:.1%} of full)")  # fmt: skip
        if self.num_swaps:
            parts.append(f"swapped out {self.num_swaps}x")
        if self.peak_reserved_bytes is not None:
            parts.append(f"peak GPU memory {self.peak_reserved_bytes / 2**30:.2f} GiB reserved")
        if self.ended is not None:
            parts.append(f"ended: {FINISH_REASONS.get(self.ended, self.ended)} ({self.ended})")
        return " | ".join(parts)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability under the model (natural log, before
    temperature and penalties) and the likeliest tokens' ``top``: (token id, log
    probability), likeliest first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """A request as it stands after a step: generated text and token ids so far (prompt
    excluded), what this step added, and why it ended once it has."""

    prompt: str | list[int]
    text: str
    token_ids: list[int]
    # "stop" (EOS or a stop string), "length" (max_new_tokens or the context) or "abort";
    # None while it runs
    finish_reason: str | None
    stats: GenerationStats = field(default_factory=GenerationStats)
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    request_id: int = -1  # as Engine.add_request returned it
    new_text: str = ""  # text this step added
    new_token_ids: list[int] = field(default_factory=list)  # tokens this step added
    # with ``logprobs`` asked: one per generated token so far, and those this step added
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    # with ``prompt_logprobs`` asked: one per prompt token (None for the first, which nothing
    # predicts), once its prefill is done
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestView:
    """One request as the engine holds it: its ``lane`` ("resident", "offload", "main";
    "queued" while it waits for the offload lane's part of the arena), its ``state``
    ("waiting", "prefilling", "decoding", "swapped"), its tokens so far, and its
    ``placement``: the (layer, kv head) entries of the head map it runs under, by tier
    ({} before it is admitted)."""

    request_id: int
    lane: str
    state: str
    prompt_tokens: int
    generated_tokens: int
    placement: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class LaneView:
    """One lane: its GPU and host pages (in all and in use), the bytes of the arena it
    holds, the layout in force (``plan``, and ``layout``: its head map's summary line; None
    before its first), what its last step did (``StepPlan.summary()``), what its tiers
    copied so far (``TierCounters``' fields), its steps and prompt tokens computed so far,
    the pinned host memory its host pages hold, whether its layout's decode steps (and a
    mixed step) ran as graphs, and the hybrid tier's CPU share in force."""

    name: str
    gpu_pages: int
    gpu_pages_used: int
    host_pages: int
    host_pages_used: int
    arena_bytes: int
    layout: str | None = None
    last_step: dict | None = None
    plan: Plan | None = None  # the layout in force (the planner's plain data)
    peak_pages: int = 0  # GPU pages its decode steps held at most (since the last run began)
    counters: dict[str, int] = field(default_factory=dict)  # its tiers' copies so far
    steps: int = 0  # steps that ran compute so far
    prefilled_tokens: float = 0.0  # prompt tokens computed so far (a layer slice: its part)
    host_bytes: int = 0  # pinned host memory of its host pages (bytes)
    decode_graphs: bool = False  # its layout's decode steps replay graphs (CUDA's or a twin)
    mixed_graphs: bool = False  # a mixed step (a piece and decode rows) ran as a graph
    cpu_share: float | None = None  # the hybrid tier's CPU share of history (None: no hybrid)


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds now (a server's metrics, a test's or benchmark's view):
    requests by state, KV pages in use per tier, the head map's (layer, kv head) entries
    per tier (summed over the running requests' lanes), swaps so far, and each request and
    lane as it stands (:class:`RequestView`, :class:`LaneView`)."""

    running: int = 0  # admitted: prefilling or decoding
    waiting: int = 0  # queued, not admitted yet
    swapped: int = 0  # swapped out to host pages
    gpu_pages_used: int = 0
    host_pages_used: int = 0
    resident_entries: int = 0
    streamed_entries: int = 0
    hybrid_entries: int = 0
    num_swaps: int = 0  # sequences swapped out since the engine started
    peak_reserved_bytes: int = 0  # GPU memory torch's allocator reserved at most (0 on CPU)
    compile_seconds: float = 0.0  # the process's compiling so far (model.compile_meter)
    requests: tuple[RequestView, ...] = ()
    lanes: tuple[LaneView, ...] = ()

    def request(self, request_id: int) -> RequestView | None:
        return next((r for r in self.requests if r.request_id == request_id), None)

    def lane(self, name: str) -> LaneView | None:
        return next((lane for lane in self.lanes if lane.name == name), None)

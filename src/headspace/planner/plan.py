"""The planner: which (layer, kv head) entries stay on the GPU, which are streamed from host
memory and in what groups, the prefill chunk, the memory table and a roofline prediction.

Pure arithmetic on the model config and the budgets: no tensors, no CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from headspace.errors import UserError
from headspace.model.config import ModelConfig
from headspace.planner.head_map import HeadEntry, HeadMap

GiB = 2**30
OFFLOAD_MODES = ("auto", "none", "layer", "head")
MIN_TRANSFER_BYTES = 64 * 2**20  # a streamed group moves at least this much per copy
MAX_PREFILL_CHUNK = 32768


@dataclass(frozen=True)
class Hardware:
    """Rates the roofline uses (bytes/s, FLOP/s); defaults: measured on an H100 machine."""

    gemm_flops: float = 790e12
    attention_flops: float = 610e12
    hbm_bytes: float = 3.0e12
    h2d_bytes: float = 54e9
    d2h_bytes: float = 55e9


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for: context in tokens, budgets in bytes."""

    context: int
    gpu_memory: int
    host_memory: int
    dtype_bytes: int = 2
    offload: str = "auto"
    head_group: int | None = None
    prefill_chunk: int | None = None


@dataclass
class Plan:
    """The planner's answer; ``memory`` in bytes, predictions in tok/s and ms."""

    head_map: HeadMap
    offload: str  # the mode used ("none", "layer" or "head")
    head_group: int  # kv heads per streamed group (0: nothing streamed)
    prefill_chunk: int
    memory: dict[str, int] = field(default_factory=dict)
    prefill_tok_s: float = 0.0
    decode_ms: float = 0.0
    decode_pcie_floor_ms: float = 0.0

    def to_dict(self) -> dict:
        return {
            "offload": self.offload, "head_group": self.head_group,
            "prefill_chunk": self.prefill_chunk, "memory_bytes": self.memory,
            "prefill_tok_s": self.prefill_tok_s, "decode_ms": self.decode_ms,
            "decode_pcie_floor_ms": self.decode_pcie_floor_ms,
            "head_map_summary": self.head_map.summary(), "head_map": self.head_map.to_dict(),
        }  # fmt: skip


def weight_bytes(config: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of all parameters (embeddings counted once when tied)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * inter
    per_layer += 2 * hidden + (q_size + 2 * kv_size if config.qkv_bias else 0)
    embeddings = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    return dtype_bytes * (config.num_layers * per_layer + embeddings + hidden)


def head_bytes(config: ModelConfig, tokens: int, dtype_bytes: int) -> int:
    """K and V bytes of one kv head of one layer over ``tokens``."""
    return 2 * tokens * config.head_dim * dtype_bytes


def activation_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    """Peak activations per prefill token (hidden states, MLP, q/out copies, expanded K/V)."""
    per_token = dtype_bytes * (6 * config.hidden_size + 3 * config.intermediate_size)
    return per_token + 4 * config.num_heads * config.head_dim * dtype_bytes


def activation_bytes(config: ModelConfig, chunk: int, dtype_bytes: int) -> int:
    """Peak activations of one prefill chunk, with the fp32 logits of its last token."""
    return chunk * activation_bytes_per_token(config, dtype_bytes) + 4 * config.vocab_size


def working_bytes(config: ModelConfig, chunk: int, dtype_bytes: int) -> int:
    """GPU bytes a prefill chunk needs besides weights and KV: its activations and as much
    again for the caching allocator's slack (cached blocks of other sizes), so that what
    the allocator reserves, not only what tensors hold, stays within the budget."""
    return 2 * activation_bytes(config, chunk, dtype_bytes)


def prefill_chunk(config: ModelConfig, room: int, context: int, dtype_bytes: int, *,
                  staging: int | None = None, hw: Hardware | None = None) -> int:  # fmt: skip
    """Prompt tokens per prefill chunk: a power of two in [512, 32768] whose activations take
    a fifth of ``room`` (bytes left after weights). When heads stream (``staging``: bytes
    that must stay free to stage them), at least the chunk whose attention FLOPs hide
    re-reading their history over PCIe, if its working bytes and the staging fit the room:
    each history byte serves ``chunk * 2 * queries_per_kv / dtype_bytes`` FLOPs.
    """
    per_token = activation_bytes_per_token(config, dtype_bytes)
    fit = max(room, 0) // 5 // per_token
    chunk = 1 << max(int(fit), 1).bit_length() - 1
    if staging is not None:
        hw = hw or Hardware()
        flops_per_byte = hw.attention_flops / hw.h2d_bytes
        balance = flops_per_byte * dtype_bytes / (2 * config.num_queries_per_kv)
        balanced = 1 << max(int(balance) - 1, 1).bit_length()  # next power of two
        if working_bytes(config, balanced, dtype_bytes) + staging <= room:
            chunk = max(chunk, balanced)
    return max(512, min(chunk, MAX_PREFILL_CHUNK, 1 << (context - 1).bit_length()))


def _plan_chunk(config: ModelConfig, request: PlanRequest, room: int, total_kv: int,
                hw: Hardware) -> int:  # fmt: skip
    """The user's chunk, else the planner's: larger when heads will stream."""
    if request.prefill_chunk:
        return request.prefill_chunk
    dtype_bytes = request.dtype_bytes
    chunk = prefill_chunk(config, room, request.context, dtype_bytes)
    streams = request.offload in ("layer", "head") or (
        request.offload == "auto" and total_kv > room - working_bytes(config, chunk, dtype_bytes)
    )
    if not streams:
        return chunk
    group = config.num_kv_heads if request.offload == "layer" else 1  # the smallest group
    staging = 2 * group * head_bytes(config, request.context, dtype_bytes)
    return prefill_chunk(config, room, request.context, dtype_bytes, staging=staging, hw=hw)


def _group_size(config: ModelConfig, request: PlanRequest, mode: str) -> int:
    """Heads per streamed group: a whole layer, the user's, or enough to make copies large."""
    if mode == "layer":
        return config.num_kv_heads
    if request.head_group:
        return min(request.head_group, config.num_kv_heads)
    per_head = head_bytes(config, request.context, request.dtype_bytes)
    return max(1, min(config.num_kv_heads, -(-MIN_TRANSFER_BYTES // per_head)))


def _resident_counts(num_resident: int, config: ModelConfig, mode: str) -> list[int]:
    """Resident heads per layer: whole layers first (layer mode), else spread evenly."""
    layers, heads = config.num_layers, config.num_kv_heads
    if mode == "layer":
        full = num_resident // heads
        return [heads if i < full else 0 for i in range(layers)]
    base, extra = divmod(min(num_resident, layers * heads), layers)
    return [min(heads, base + (1 if i < extra else 0)) for i in range(layers)]


def _head_map(config: ModelConfig, resident: list[int], group: int) -> HeadMap:
    entries = []
    for layer, num_resident in enumerate(resident):
        for head in range(config.num_kv_heads):
            if head < num_resident:
                entries.append(HeadEntry(layer, head))
            else:
                streamed_index = head - num_resident
                entries.append(HeadEntry(layer, head, tier="stream", group=streamed_index // group))
    return HeadMap(config.num_layers, config.num_kv_heads, entries)


def prefill_compute_seconds(config: ModelConfig, context: int, hw: Hardware) -> float:
    """Seconds of a ``context``-token prefill if its layer GEMMs and causal attention ran at
    ``hw``'s FLOP rates (the compute roofline)."""
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    layer_params = weight_bytes(config, 1) - embeddings
    gemm_s = 2 * layer_params * context / hw.gemm_flops
    attention_flops = 2 * config.num_heads * config.head_dim * context**2 * config.num_layers
    return gemm_s + attention_flops / hw.attention_flops


def _predict(plan: Plan, config: ModelConfig, request: PlanRequest, hw: Hardware) -> None:
    """Roofline: prefill = max(compute, PCIe traffic); decode = max(HBM reads, PCIe reads)."""
    context, dtype_bytes, chunk = request.context, request.dtype_bytes, plan.prefill_chunk
    weights = weight_bytes(config, dtype_bytes)
    embed_bytes = config.vocab_size * config.hidden_size * dtype_bytes
    compute_s = prefill_compute_seconds(config, context, hw)
    streamed = plan.head_map.count("stream")
    num_chunks = -(-context // chunk)
    prefix_tokens = chunk * num_chunks * (num_chunks - 1) // 2  # prefixes re-read per chunk
    h2d_s = streamed * head_bytes(config, prefix_tokens, dtype_bytes) / hw.h2d_bytes
    d2h_s = streamed * head_bytes(config, context, dtype_bytes) / hw.d2h_bytes
    plan.prefill_tok_s = context / max(compute_s, h2d_s + d2h_s)
    resident = plan.head_map.count("gpu") * head_bytes(config, context, dtype_bytes)
    hbm_s = (weights - embed_bytes + resident) / hw.hbm_bytes
    pcie_s = streamed * head_bytes(config, context, dtype_bytes) / hw.h2d_bytes
    plan.decode_ms = 1000 * max(hbm_s, pcie_s)
    plan.decode_pcie_floor_ms = 1000 * pcie_s


def _layout(config: ModelConfig, request: PlanRequest, mode: str, free: int,
            per_head: int) -> tuple[list[int], int, int]:  # fmt: skip
    """Resident heads per layer, streamed group size and staging bytes for ``mode`` within
    ``free`` bytes of GPU memory."""
    num_entries = config.num_layers * config.num_kv_heads
    if mode == "none":
        if num_entries * per_head > free:
            raise UserError(
                f"the KV cache of {request.context} tokens ({num_entries * per_head / GiB:.2f} "
                f"GiB) does not fit the {free / GiB:.2f} GiB the GPU budget leaves; use offload "
                "(auto, layer, head)"
            )
        return [config.num_kv_heads] * config.num_layers, 0, 0
    group = _group_size(config, request, mode)
    while group > 1 and mode == "head" and 2 * group * per_head > free:
        group -= 1
    staging = 2 * group * per_head  # double-buffered: one group computes, one arrives
    if staging > free:
        raise UserError(
            f"GPU budget too small: streaming needs {staging / GiB:.2f} GiB of staging for "
            f"{group} head(s) x {request.context} tokens, but only {free / GiB:.2f} GiB is "
            "left after weights and activations"
        )
    num_resident = min(num_entries, (free - staging) // per_head)
    return _resident_counts(num_resident, config, mode), group, staging


def make_plan(config: ModelConfig, request: PlanRequest, hw: Hardware | None = None) -> Plan:
    """Fill the head map for ``request``; raises UserError with the numbers when it cannot."""
    hw = hw or Hardware()
    if request.offload not in OFFLOAD_MODES:
        raise UserError(
            f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {request.offload!r}"
        )
    if request.context < 1:
        raise UserError(f"context must be a positive number of tokens, got {request.context}")
    dtype_bytes = request.dtype_bytes
    weights = weight_bytes(config, dtype_bytes)
    per_head = head_bytes(config, request.context, dtype_bytes)
    total_kv = config.num_layers * config.num_kv_heads * per_head
    room = request.gpu_memory - weights
    chunk = _plan_chunk(config, request, room, total_kv, hw)
    activations = activation_bytes(config, chunk, dtype_bytes)
    slack = working_bytes(config, chunk, dtype_bytes) - activations
    free = room - activations - slack
    if free < 0:
        raise UserError(
            f"GPU budget too small: weights ({weights / GiB:.2f} GiB) and activations of a "
            f"{chunk}-token prefill chunk ({(activations + slack) / GiB:.2f} GiB with allocator "
            f"slack) exceed {request.gpu_memory / GiB:.2f} GiB"
        )
    mode = "none" if request.offload == "auto" and total_kv <= free else request.offload
    mode = "head" if mode == "auto" else mode
    resident, group, staging = _layout(config, request, mode, free, per_head)
    head_map = _head_map(config, resident, max(group, 1))
    host_kv = head_map.count("stream") * per_head
    if host_kv > request.host_memory:
        raise UserError(
            f"a context of {request.context} tokens needs {host_kv / GiB:.2f} GiB of host memory "
            f"for streamed KV, more than the {request.host_memory / GiB:.2f} GiB host budget"
        )
    gpu_kv = head_map.count("gpu") * per_head
    memory = {
        "weights": weights, "gpu_kv": gpu_kv, "staging": staging,
        "activations": activations, "allocator_slack": slack,
        "total_gpu": weights + gpu_kv + staging + activations + slack,
        "host_kv": host_kv, "total_host": host_kv,
    }  # fmt: skip
    streaming = head_map.count("stream") > 0
    plan = Plan(head_map, mode if streaming else "none", group if streaming else 0, chunk, memory)
    _predict(plan, config, request, hw)
    return plan

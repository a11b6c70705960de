"""Byte arithmetic shared by the planner and the engine: weights, activations, KV pages and
the GPU budget's split. Pure arithmetic: no tensors, no CUDA.

One source for every consumer: the engine sizes its KV arena with :func:`gpu_arena_bytes`
and the planner lays pages and staging out inside the same number of bytes, so a budget the
planner accepts is a budget the pool can hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from headspace.errors import UserError
from headspace.kv.spec import byte_size
from headspace.model.config import ModelConfig

MAX_PREFILL_CHUNK = 32768
MIN_PREFILL_CHUNK = 128


@dataclass(frozen=True)
class Hardware:
    """Rates the roofline uses (bytes/s, FLOP/s); defaults: measured on an H100 machine."""

    gemm_flops: float = 790e12
    prompt_flops: float = 495e12  # a whole prefill forward's pace, in its linear layers'
    # FLOPs a second (norms, rotary, attention over a short prefix and launches included):
    # Llama-3.1-8B prefilled 35.5K tokens/s at 8K on an H100 (regress, 2026-12-07), 13.96
    # GFLOP a token. The scheduler prices a prompt piece beside decode rows at this pace
    attention_flops: float = 610e12
    hbm_bytes: float = 3.0e12
    h2d_bytes: float = 54e9
    d2h_bytes: float = 55e9
    cpu_attention_bytes: float = 55e9  # the CPU kernel's share-setting rate, 16-core host
    # (0: no CPU attention here, so ``offload="auto"`` never picks the hybrid tier)
    hybrid_layer_seconds: float = 1.2e-3  # per layer with hybrid heads, on the CPU's path:
    # from its (out, lse) to the next layer's query (the merge, the rest of the layer, the
    # next query's copy); measured on an H200 host at 128K (bench/profiles/profile_hybrid_split.py)
    graph_gather_share: float = 0.8  # of ``h2d_bytes``: a CUDA-graph decode step's gather
    # kernels beside its attention (the copy engine needs copy sizes known on the host)
    copy_seconds: float = 20e-6  # what each copy of a divided kv head adds to its rank's
    # step: at decode its rows join the own heads' kernel launch and the layer's merge is a
    # fixed few kernels and one lse all-gather (bench/profiles/copy_cost.py); 73-100 us a copy when
    # each copy ran its own key range, launch and merge (four H100s, 2026-11-26). The merge
    # is now a cost per layer (every rank's, once any copies) priced here per copy; charged
    # at prefill too, where a copy still runs its own calls (not measured there)
    copy_row_seconds: float = 0.27e-6  # ... and at decode, per sequence of the batch: end to
    # end a copy cost 89 us a step at 256 sequences beyond its kernel rows (two H100s,
    # Qwen2.5-3B shapes, 29 copies each split two ways: the step 2.57 ms longer than the two
    # uniform runs' mean with the attention's critical path unchanged; bench/NOTES.md), 20
    # us of it the fixed part above. One batch measured: how it splits between a part per
    # copy and a part per sequence is assumed; four-way splits cost more (four H200s)
    decode_row_seconds: float = 0.12e-6  # the decode kernel's work per (sequence, kv head)
    # row beside its bytes, which each copy repeats: a layer's kernel took 14 us + 31 us a
    # head at 256 sequences + its K/V at 3.6 TB/s (31.7 us a head with the K/V held at
    # ``hbm_bytes``; fit to 144 layer times, two H100s, 2026-11-28)
    eager_step_seconds: float = 48e-3  # the host's work of an eager decode step: per step
    eager_group_seconds: float = 0.35e-3  # ... and per streamed group (its copies, attention
    # and write launches): 0.25-0.6 ms on the H100 hosts measured (Llama-3.1-8B; bench/NOTES.md
    # "Streamed heads at 32K, eager against graph steps"), the middle figure


def balanced_share(cpu_bytes_per_s: float, h2d_bytes_per_s: float) -> float:
    """The CPU's share of the hybrid tier's offloaded history when CPU attention and PCIe
    run together and should finish together."""
    return cpu_bytes_per_s / (cpu_bytes_per_s + h2d_bytes_per_s)


def hybrid_share(cpu_share: float | None, hw: Hardware | None = None) -> float:
    """The hybrid tier's CPU share: the one asked for, else the rates' balance."""
    if cpu_share is not None:
        return cpu_share
    hw = hw or Hardware()
    return balanced_share(hw.cpu_attention_bytes, hw.h2d_bytes)


def offloaded_seconds(offloaded_bytes: float, num_layers: int, hybrid: bool,
                      cpu_share: float | None, hw: Hardware) -> float:  # fmt: skip
    """Seconds per decode step to attend ``offloaded_bytes`` of host-resident KV spread over
    ``num_layers`` layers: over PCIe alone, or with the hybrid tier PCIe and CPU threads
    together (``cpu_share`` of the bytes on the CPU) plus the per-layer hand-off."""
    if not hybrid:
        return offloaded_bytes / hw.h2d_bytes
    share = hybrid_share(cpu_share, hw)
    cpu_s = 0.0
    if share:  # no CPU attention here: the CPU's part never ends
        rate = hw.cpu_attention_bytes
        cpu_s = share * offloaded_bytes / rate if rate > 0 else math.inf
    pcie_s = (1 - share) * offloaded_bytes / hw.h2d_bytes
    return max(cpu_s, pcie_s) + num_layers * hw.hybrid_layer_seconds


def graph_step_faster(streamed_bytes: float, num_groups: int, hw: Hardware | None = None) -> bool:
    """Whether a decode step that streams ``streamed_bytes`` of history in ``num_groups``
    head groups runs faster as a CUDA graph (gather kernels at a share of the link's rate,
    no host work) than eagerly (copy-engine copies at the link's rate, unless the host's
    work of issuing them and the step's other launches takes longer)."""
    hw = hw or Hardware()
    graph_s = streamed_bytes / (hw.graph_gather_share * hw.h2d_bytes)
    host_s = hw.eager_step_seconds + num_groups * hw.eager_group_seconds
    return graph_s <= max(streamed_bytes / hw.h2d_bytes, host_s)


def layer_weight_bytes(config: ModelConfig, dtype_bytes: int, kv_heads: int | None = None,
                       world: int = 1) -> int:  # fmt: skip
    """Bytes of one decoder layer's parameters (norms, q/k/v, o_proj, the MLP); of a rank's
    part with ``kv_heads`` kv heads (and their query heads) and a ``1/world`` MLP slice
    rounded up (``parallel.shard``)."""
    kv_heads = config.num_kv_heads if kv_heads is None else kv_heads
    hidden, inter = config.hidden_size, -(-config.intermediate_size // world)
    q_size = kv_heads * config.num_queries_per_kv * config.head_dim
    kv_size = kv_heads * config.head_dim
    per_layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * inter
    per_layer += 2 * hidden + (q_size + 2 * kv_size if config.qkv_bias else 0)
    return dtype_bytes * per_layer


def outer_weight_bytes(config: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of the parameters outside the decoder layers: embeddings and LM head (once
    when tied), the final norm."""
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return dtype_bytes * (embeddings + config.hidden_size)


def weight_bytes(config: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of all parameters (embeddings counted once when tied)."""
    layers = config.num_layers * layer_weight_bytes(config, dtype_bytes)
    return layers + outer_weight_bytes(config, dtype_bytes)


WeightMode = Literal["auto", "gpu", "stream"]
WEIGHT_MODES = get_args(WeightMode)
STREAM_DEPTH = 2  # GPU slots of streamed layers: one computes while the next arrives


@dataclass(frozen=True)
class WeightSpec:
    """Where the weights live and their bytes. Decoder layers are resident on the GPU, or
    ``streamed``: held in pinned host memory and copied, layer by layer, into ``depth`` GPU
    slots while the layer before computes (FlexAttn's CPIP). Embeddings, the final norm and
    the LM head stay resident either way."""

    num_layers: int
    layer_bytes: int  # one decoder layer (this rank's part under torch.distributed)
    other_bytes: int  # embeddings, final norm, LM head
    streamed: bool = False
    depth: int = STREAM_DEPTH

    @classmethod
    def of(cls, config: ModelConfig, dtype_bytes: int, streamed: bool = False,
           world: int = 1, kv_heads: int | None = None) -> WeightSpec:  # fmt: skip
        """The model's weights; with ``world`` ranks, the largest rank's part of a layer: at
        most ``kv_heads`` kv heads (default: a ``1/world`` share rounded up) and its MLP
        slice."""
        if kv_heads is None:
            kv_heads = -(-config.num_kv_heads // world)
        layer = layer_weight_bytes(config, dtype_bytes, kv_heads, world)
        return cls(config.num_layers, layer, outer_weight_bytes(config, dtype_bytes), streamed)

    @property
    def gpu_bytes(self) -> int:
        """Bytes the weights take on the GPU."""
        layers = min(self.depth, self.num_layers) if self.streamed else self.num_layers
        return self.other_bytes + layers * self.layer_bytes

    @property
    def host_bytes(self) -> int:
        """Pinned host bytes of the streamed layers (0 when resident): what each forward
        pass (a prefill chunk, a decode step) copies over PCIe."""
        return self.num_layers * self.layer_bytes if self.streamed else 0


def streams_weights(mode: str, config: ModelConfig, budget: int | None, dtype_bytes: int,
                    max_batch: int = 1, chunk: int | None = None, world: int = 1,
                    kv_heads: int | None = None) -> bool:  # fmt: skip
    """Whether decoder layers stream from host memory: as asked ("gpu", "stream"), or with
    "auto" when resident weights leave no room for KV in ``budget`` bytes beside a prefill
    chunk (the one given, else the smallest) and batched decode, and streamed ones do
    (never without a budget; where neither fits, the resident weights are refused with the
    numbers). ``world``, ``kv_heads``: a rank's part (:meth:`WeightSpec.of`)."""
    if mode != "auto":
        return mode == "stream"
    if budget is None:
        return False
    working = working_bytes(config, chunk or MIN_PREFILL_CHUNK, dtype_bytes)
    working += decode_bytes(config, max_batch, dtype_bytes)

    def fits(streamed: bool) -> bool:
        weights = WeightSpec.of(config, dtype_bytes, streamed, world, kv_heads)
        return weights.gpu_bytes + working < budget

    return not fits(False) and fits(True)


def head_bytes(config: ModelConfig, tokens: int, dtype_bytes: int) -> int:
    """K and V bytes of one kv head of one layer over ``tokens``."""
    return 2 * tokens * config.head_dim * dtype_bytes


def activation_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    """Peak activations per prefill token (hidden states, MLP, q/out copies, and K/V
    expanded to every query head, as the efficient and flash kernels take them; cuDNN and
    the CPU's kernel take them unexpanded, 12 KiB a token fewer for Llama-3.1-8B, not
    counted off)."""
    per_token = dtype_bytes * (6 * config.hidden_size + 3 * config.intermediate_size)
    return per_token + 4 * config.num_heads * config.head_dim * dtype_bytes


def activation_bytes(config: ModelConfig, chunk: int, dtype_bytes: int) -> int:
    """Peak activations of one prefill chunk, with the fp32 logits of its last token."""
    return chunk * activation_bytes_per_token(config, dtype_bytes) + 4 * config.vocab_size


def decode_bytes(config: ModelConfig, max_batch: int, dtype_bytes: int) -> int:
    """Buffers of batched decode kept beside the prefill activations: the fp32 logits of a
    full batch and its sampled tokens (CUDA graphs share one pool for the rest)."""
    return max_batch * (4 * config.vocab_size + activation_bytes_per_token(config, dtype_bytes))


def working_bytes(config: ModelConfig, chunk: int, dtype_bytes: int) -> int:
    """GPU bytes a prefill chunk needs besides weights and KV: its activations and as much
    again for the caching allocator's slack (cached blocks of other sizes), so that what
    the allocator reserves, not only what tensors hold, stays within the budget."""
    return 2 * activation_bytes(config, chunk, dtype_bytes)


def balanced_chunk(config: ModelConfig, dtype_bytes: int, hw: Hardware | None = None,
                   streamed: bool = False) -> int:  # fmt: skip
    """The smallest power-of-two chunk whose FLOPs hide what it re-reads over PCIe: streamed
    history (each byte serves ``chunk * 2 * queries_per_kv / dtype_bytes`` attention FLOPs)
    and, with ``streamed`` weights, each layer's weights (each weight serves ``2 * chunk``
    GEMM FLOPs)."""
    hw = hw or Hardware()
    balance = hw.attention_flops / hw.h2d_bytes * dtype_bytes / (2 * config.num_queries_per_kv)
    if streamed:
        balance = max(balance, hw.gemm_flops / hw.h2d_bytes * dtype_bytes / 2)
    return 1 << max(int(balance) - 1, 1).bit_length()


def prefill_chunk(config: ModelConfig, room: int, context: int, dtype_bytes: int,
                  hw: Hardware | None = None, streamed: bool = False) -> int:  # fmt: skip
    """Prompt tokens per prefill chunk: a power of two in [128, 32768] whose activations take
    a fifth of ``room`` (bytes left after weights), at most the context rounded up. Raised
    to the :func:`balanced_chunk` (streamed heads re-read their history once per chunk,
    ``streamed`` weights come once per chunk) when its working memory takes at most three
    quarters of the room."""
    per_token = activation_bytes_per_token(config, dtype_bytes)
    fit = max(room, 0) // 5 // per_token
    chunk = 1 << max(int(fit), 1).bit_length() - 1
    balanced = min(balanced_chunk(config, dtype_bytes, hw, streamed), MAX_PREFILL_CHUNK)
    if chunk < balanced and working_bytes(config, balanced, dtype_bytes) <= 3 * room // 4:
        chunk = balanced
    return max(MIN_PREFILL_CHUNK, min(chunk, MAX_PREFILL_CHUNK, 1 << (context - 1).bit_length()))


@dataclass(frozen=True)
class GpuSplit:
    """How a GPU budget splits (bytes): weights, working memory, and the KV arena that holds
    resident pages and the staging of streamed heads."""

    budget: int
    weights: int
    activations: int
    allocator_slack: int
    decode: int

    @property
    def arena(self) -> int:
        return self.budget - self.weights - self.activations - self.allocator_slack - self.decode


def split_gpu_budget(config: ModelConfig, budget: int, weights: int, chunk: int,
                     dtype_bytes: int, max_batch: int = 1) -> GpuSplit:  # fmt: skip
    """Split ``budget`` bytes; raises UserError with the numbers when nothing is left for KV."""
    activations = activation_bytes(config, chunk, dtype_bytes)
    split = GpuSplit(budget, weights, activations,
                     working_bytes(config, chunk, dtype_bytes) - activations,
                     decode_bytes(config, max_batch, dtype_bytes))  # fmt: skip
    if split.arena <= 0:
        raise UserError(
            f"GPU budget too small: {byte_size(budget)} holds the weights "
            f"({byte_size(weights)}) and the activations of a {chunk}-token prefill chunk "
            f"with allocator slack ({byte_size(activations + split.allocator_slack)}) "
            f"and batched decode ({byte_size(split.decode)}), but leaves no room for KV"
        )
    return split


def prefill_compute_seconds(config: ModelConfig, context: int, hw: Hardware,
                            attention_share: float = 1.0) -> float:  # fmt: skip
    """Seconds of a ``context``-token prefill if its layer GEMMs and causal attention (of
    which the heads' patterns compute ``attention_share``) ran at ``hw``'s FLOP rates (the
    compute roofline)."""
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    layer_params = weight_bytes(config, 1) - embeddings
    gemm_s = 2 * layer_params * context / hw.gemm_flops
    attention_flops = 2 * config.num_heads * config.head_dim * context**2 * config.num_layers
    return gemm_s + attention_share * attention_flops / hw.attention_flops

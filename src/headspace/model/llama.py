"""Lean Llama-family decoder (Llama 2/3, Mistral, Qwen2), token-major and cache-agnostic.

The model never owns the KV cache: each layer hands its rotated q, k, v to an
``AttentionFn`` supplied by the engine, which stores k/v wherever the head map says and
returns the attention output. Hidden states are ``[tokens, hidden]`` (no batch axis).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from headspace.model.config import ModelConfig
from headspace.model.rope import apply_rope, inverse_frequencies, rope_cos_sin

# (layer index, q [tokens, heads, dim], kv [2, tokens, kv_heads, dim]) -> [tokens, heads, dim]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
# what a slice of decoder layers hands the next (a prefill chunk run a few layers a step):
# the residual stream [tokens, hidden] and its last layer's MLP output [tokens, hidden], not
# yet added; the next layer adds them in its norm's kernel, as in a whole pass, so slices
# round as the whole pass does
SliceStates = tuple[torch.Tensor, torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, cast back before the weight (as transformers does)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def qkv_block(
    x: torch.Tensor,  # [tokens, hidden], the residual stream
    pending: torch.Tensor | None,  # [tokens, hidden]: the layer before's MLP output, not added
    norm_weight: torch.Tensor,
    eps: float,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    cos: torch.Tensor,  # [tokens, head_dim]
    sin: torch.Tensor,
    shape: tuple[int, int, int],  # (heads, kv_heads, head_dim)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Residual add of ``pending`` (in the norm's kernel: the layer before's down projection
    then needs no copy of the residual stream into its output), norm, fused q/k/v
    projection and rope.

    Returns the residual stream ``[tokens, hidden]``, ``q [tokens, heads, dim]`` and
    ``kv [2, tokens, kv_heads, dim]`` (K then V), token-major: fused attention kernels read
    the head-major views of these in place.
    """
    if pending is not None:
        x = x + pending
    num_heads, num_kv_heads, head_dim = shape
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = F.linear(rms_norm(x, norm_weight, eps), qkv_weight, qkv_bias)
    q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    num_tokens = x.shape[0]  # explicit: a rank may hold no head of a layer (parallel.shard)
    q = apply_rope(q.view(num_tokens, num_heads, head_dim), cos, sin)
    k = apply_rope(k.view(num_tokens, num_kv_heads, head_dim), cos, sin)
    return x, q, torch.stack((k, v.view(num_tokens, num_kv_heads, head_dim)))


def mlp_block(
    x: torch.Tensor,  # [tokens, hidden], the residual stream
    attn_out: torch.Tensor,  # [tokens, hidden], the output projection's (summed over ranks)
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add of the attention's output, then norm and the SwiGLU MLP: returns the
    residual stream ``[tokens, hidden]`` and the MLP's output ``[tokens, hidden]`` (a sharded
    layer's partial output, summed over ranks before its residual add)."""
    x = x + attn_out
    gate, up = F.linear(rms_norm(x, norm_weight, eps), gate_up_weight, gate_up_bias).chunk(2, -1)
    return x, F.linear(F.silu(gate) * up, down_weight, down_bias)


def output_mlp_block(
    x: torch.Tensor,  # [tokens, hidden], the residual stream
    attn: torch.Tensor,  # [tokens, heads, head_dim]
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None,
    *mlp_weights,  # mlp_block's, after its two inputs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output projection + residual, then norm and SwiGLU MLP: the residual stream and the
    MLP's output, each ``[tokens, hidden]`` (added by the next layer's :func:`qkv_block`)."""
    return mlp_block(x, F.linear(attn.reshape(x.shape[0], -1), o_weight, o_bias), *mlp_weights)


# Compiled blocks run, compile and are captured in CUDA graphs by one thread at a time (the
# engine's lanes step on two threads): torch.compile is not thread-safe, and a device-wide
# synchronisation or page-locking in one thread (the host pages' growth) would break
# another's capture. Held around each compiled call, each capture and each such change.
DEVICE_LOCK = threading.RLock()


def serialised(fn):
    """``fn`` called under :data:`DEVICE_LOCK`."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with DEVICE_LOCK:
            return fn(*args, **kwargs)

    return call


class Blocks:
    """The per-layer compute blocks, eager or compiled (same functions, same math).

    ``mode``: "eager"; "static" (torch.compile for one fixed shape: full prefill chunks,
    the decode step); "dynamic" (torch.compile over any number of tokens: prefill chunks);
    "tuned" (as "static", with Inductor's max-autotune and coordinate-descent tuning: the
    decode step's GEMVs and their fused elementwise kernels chosen by timing, once per
    shape; kept in the compile cache); "rows" (Inductor's defaults, compiled once for every
    count of rows past one, the count symbolic, and once for a single row: the decode
    step's batch buckets 2, 4, 8, ... share one compile, its GEMMs cuBLAS's chosen per call).
    """

    MODES = ("eager", "static", "dynamic", "tuned", "rows")

    def __init__(self, mode: str = "eager"):
        assert mode in self.MODES
        # a sharded layer runs ``mlp`` between its two sums over ranks (compiled pieces
        # with the collectives outside them)
        self.qkv, self.output_mlp, self.mlp = qkv_block, output_mlp_block, mlp_block
        if mode != "eager":
            # static mode compiles once per token count (the decode step's batch buckets,
            # the chunk size), and under ranks once per number of heads a layer holds; with
            # fullgraph, passing the limit is an error
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
            compile_options = {"fullgraph": True, "dynamic": mode == "dynamic"}
            options = tuned_options() if mode == "tuned" else ruled_options()
            if options:
                compile_options["options"] = options
            rows = mode == "rows"
            self.qkv = _compiled(qkv_block, compile_options, QKV_ROW_ARGS if rows else ())
            self.output_mlp = _compiled(output_mlp_block, compile_options,
                                        OUTPUT_MLP_ROW_ARGS if rows else ())  # fmt: skip
            self.mlp = _compiled(mlp_block, compile_options, MLP_ROW_ARGS if rows else ())


# the arguments of each block whose first dimension is the token count (x, pending, cos,
# sin; x, attn; x, attn_out): symbolic in the "rows" blocks
QKV_ROW_ARGS, OUTPUT_MLP_ROW_ARGS, MLP_ROW_ARGS = (0, 1, 6, 7), (0, 1), (0, 1)


def _compiled(fn, compile_options: dict, row_args: tuple[int, ...]):
    """``fn`` compiled (called under :data:`DEVICE_LOCK`); with ``row_args``, the first
    dimension of those tensor arguments symbolic whenever it is past one (a single row is
    compiled apart: torch.compile specialises sizes 0 and 1)."""
    compiled = torch.compile(fn, **compile_options)
    if not row_args:
        return serialised(compiled)

    @functools.wraps(fn)
    def call(*args):
        if args[0].shape[0] > 1:
            for index in row_args:
                if args[index] is not None:
                    torch._dynamo.mark_dynamic(args[index], 0)
        with DEVICE_LOCK:
            return compiled(*args)

    return call


# Inductor's settings for the "tuned" blocks: at one row a layer's output projection and MLP
# took 101.4 against 106.7 us (Llama-3.1-8B shapes, 8 layers in a CUDA graph, an H200;
# q/k/v unchanged), the first compile 26.7 against 14.9 s (bench/NOTES.md). The engine
# captures its own graphs: Inductor's stay off
TUNED_OPTIONS = {"max_autotune": True, "coordinate_descent_tuning": True,
                 "triton.cudagraphs": False}  # fmt: skip
# ... and its tables of timed choices, written to stderr at each GEMM, kept from the user
QUIET_OPTIONS = {"autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}


def tuned_options() -> dict:
    """:data:`TUNED_OPTIONS` with those of :data:`QUIET_OPTIONS` this torch knows."""
    import torch._inductor.config as inductor_config

    quiet = {k: v for k, v in QUIET_OPTIONS.items() if hasattr(inductor_config, k)}
    return {**TUNED_OPTIONS, **quiet}


def ruled_options() -> dict:
    """Inductor's deterministic mode for the blocks that are not tuned: a kernel
    configuration that changes the sums (a reduction's block sizes) is chosen by rule, not by
    timing the candidates on this GPU, so that greedy tokens do not depend on a first
    process's timings or on what the compile cache held (fresh H100 processes had given
    different continuations of one 32K prompt after about 15 tokens). Per compile, not
    process-wide (a user's own torch.compile keeps its settings); none where the user set
    ``TORCHINDUCTOR_DETERMINISTIC`` or this torch has no such mode."""
    import torch._inductor.config as inductor_config

    if "TORCHINDUCTOR_DETERMINISTIC" in os.environ or not hasattr(inductor_config, "deterministic"):
        return {}
    return {"deterministic": True}


EAGER_BLOCKS = Blocks()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DecoderLayer(nn.Module):
    """One transformer block; q/k/v and gate/up projections are fused into single GEMMs."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.shape = (config.num_heads, config.num_kv_heads, config.head_dim)
        q_size = config.num_heads * config.head_dim
        qkv_size = q_size + 2 * config.num_kv_heads * config.head_dim
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)
        inter = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * inter, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inter, config.hidden_size, bias=config.mlp_bias)
        # with part of the heads and MLP (parallel.shard): sums partial outputs over ranks
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self,
        layer_idx: int,
        x: torch.Tensor,  # [tokens, hidden]
        cos: torch.Tensor,  # [tokens, head_dim]
        sin: torch.Tensor,
        attention: AttentionFn,
        blocks: Blocks = EAGER_BLOCKS,
        pending: torch.Tensor | None = None,  # [tokens, hidden]: the layer before's MLP output
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after this layer's attention and its MLP's output (summed
        over ranks), each ``[tokens, hidden]``: the stream after the layer is their sum,
        which the next layer adds in its norm's kernel (:func:`qkv_block`)."""
        norm, qkv = self.input_norm, self.qkv_proj
        qkv_fn = blocks.qkv if self.shape[1] else qkv_block  # a rank may hold no head here
        x, q, kv = qkv_fn(x, pending, norm.weight, norm.eps, qkv.weight, qkv.bias, cos, sin,
                          self.shape)  # fmt: skip
        attn = attention(layer_idx, q, kv)  # [tokens, heads, head_dim]
        post, o, gate_up, down = (
            self.post_attention_norm,
            self.o_proj,
            self.gate_up_proj,
            self.down_proj,
        )
        mlp_weights = (post.weight, post.eps, gate_up.weight, gate_up.bias, down.weight,
                       down.bias)  # fmt: skip
        if self.reduce is None:
            return blocks.output_mlp(x, attn, o.weight, o.bias, *mlp_weights)
        # a sharded layer: its partial outputs are summed over ranks between the blocks
        attn_out = self.reduce(F.linear(attn.reshape(x.shape[0], -1), o.weight, o.bias))
        x, out = blocks.mlp(x, attn_out, *mlp_weights)
        return x, self.reduce(out)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head of a Llama-family model."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # on the meta device (the loader's) an op with a Python reference there imports
        # Dynamo (seconds at start-up, for an engine that may never compile): the embedding
        # is initialised as nn.Embedding would, unless on meta, and the rope computed on the CPU
        table = torch.empty(config.vocab_size, config.hidden_size)  # [vocab, hidden]
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=table)
        if not table.is_meta:
            nn.init.normal_(self.embed_tokens.weight)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        with torch.device("cpu"):
            inv_freq = inverse_frequencies(config.rope, config.head_dim)
        self.register_buffer("inv_freq", inv_freq.to(table.device), persistent=False)
        self._blocks: dict[str, Blocks] = {"eager": EAGER_BLOCKS}
        # what forward iterates for its decoder layers: ``layers``, or an iterable that
        # yields each one ready on the device (the engine's weights streamed from the host)
        self.layer_source: Iterable[DecoderLayer] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [tokens] int64
        positions: torch.Tensor,  # [tokens] int64, absolute positions
        attention: AttentionFn,
        blocks_mode: str = "eager",
        layers: tuple[int, int] | None = None,
        hidden: SliceStates | None = None,
    ) -> torch.Tensor | SliceStates:
        """Final-normed hidden states ``[tokens, hidden]`` (call ``logits`` on the rows needed).

        ``blocks_mode`` (see :class:`Blocks`): "static" compiles per token count (full
        prefill chunks, the decode step: fastest kernels), "tuned" likewise with Inductor's
        max-autotune (the graphed decode step), "dynamic" once for any count.
        ``layers`` (first, end): run decoder layers ``first .. end-1`` only, from ``hidden``
        (the :data:`SliceStates` after layer ``first - 1``; the embeddings when ``first``
        is 0); returns the :data:`SliceStates` after layer ``end - 1``, or the final-normed
        states after the model's last layer (a prefill chunk computed a few layers a step).
        Not with streamed weights.
        """
        if blocks_mode not in self._blocks:
            self._blocks[blocks_mode] = Blocks(blocks_mode)
        blocks = self._blocks[blocks_mode]
        first, end = (0, len(self.layers)) if layers is None else layers
        x, pending = (self.embed_tokens(input_ids), None) if first == 0 else hidden
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        if self.layer_source is not None:  # yields every layer in order
            assert (first, end) == (0, len(self.layers)), "streamed weights run every layer"
            source = enumerate(self.layer_source)
        else:
            source = ((i, self.layers[i]) for i in range(first, end))
        for layer_idx, layer in source:  # each one's MLP output added in the next's norm
            x, pending = layer(layer_idx, x, cos, sin, attention, blocks, pending)
        if end < len(self.layers):
            return x, pending
        return self.norm(x if pending is None else x + pending)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits ``[tokens, vocab]`` in float32 from final hidden states."""
        return self.lm_head(hidden).float()

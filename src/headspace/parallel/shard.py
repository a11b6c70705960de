"""Per-rank weight layout (FlexAttn's WPR): after loading, each rank keeps the q/k/v rows and
o_proj columns of the kv heads (with their query heads) the head map gives it, layer by
layer, and a contiguous slice of the MLP (tensor parallel); the rest is freed once, not
sliced per step. The partial outputs of a layer's o_proj and down_proj are summed over ranks
by ``reduce`` (an all-reduce under torch.distributed). Embeddings, norms and the LM head stay
whole on every rank. The model code never mentions ranks: a sharded layer holds fewer heads
and a ``reduce`` function."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from headspace.planner.head_map import HeadMap


def rank_heads(head_map: HeadMap, rank: int) -> list[list[int]]:
    """``[layer]`` -> the kv heads ``rank`` computes there (copies included), ascending."""
    return [[e.kv_head for e in head_map.layer(layer) if rank in e.rank]
            for layer in range(head_map.num_layers)]  # fmt: skip


def mlp_slice(intermediate: int, rank: int, world: int) -> slice:
    """Rank ``rank``'s contiguous share of the MLP's ``intermediate`` columns (the first
    ``intermediate % world`` ranks take one more)."""
    base, extra = divmod(intermediate, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A Linear over ``weight`` [out, in] (``out`` may be 0: a rank with no head here)."""
    layer = nn.Linear(1, 1, bias=bias is not None, device="meta")  # no init of a 0-row weight
    layer.in_features, layer.out_features = weight.shape[1], weight.shape[0]
    layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.contiguous(), requires_grad=False)
    return layer


def shard_layer(layer: nn.Module, kv_heads: list[int], rank: int, world: int,
                reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:  # fmt: skip
    """Keep ``layer``'s weights for ``kv_heads`` (with their query heads) and rank ``rank``'s
    MLP slice; the biases added after ``reduce`` (o_proj's, down_proj's) stay on rank 0 only.
    The sharded layer sums its o_proj output, runs ``mlp_block`` (compiled like the whole
    layer's blocks), then sums its down_proj output."""
    num_heads, num_kv_heads, head_dim = layer.shape
    group = num_heads // num_kv_heads
    index = torch.tensor(kv_heads, dtype=torch.long)
    q_rows = ((index[:, None] * group + torch.arange(group)).flatten()[:, None] * head_dim
              + torch.arange(head_dim)).flatten()  # fmt: skip
    kv_rows = (index[:, None] * head_dim + torch.arange(head_dim)).flatten()
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    rows = torch.cat([q_rows, q_size + kv_rows, q_size + kv_size + kv_rows])
    qkv, o = layer.qkv_proj, layer.o_proj
    layer.qkv_proj = _linear(
        qkv.weight.data[rows], None if qkv.bias is None else qkv.bias.data[rows]
    )
    layer.o_proj = _linear(o.weight.data[:, q_rows], _first_rank(o.bias, rank))
    cols = mlp_slice(layer.down_proj.weight.shape[1], rank, world)
    gate_up, down = layer.gate_up_proj, layer.down_proj
    inter = down.weight.shape[1]
    gate_up_rows = torch.cat([torch.arange(inter)[cols], inter + torch.arange(inter)[cols]])
    gate_up_bias = None if gate_up.bias is None else gate_up.bias.data[gate_up_rows]
    layer.gate_up_proj = _linear(gate_up.weight.data[gate_up_rows], gate_up_bias)
    layer.down_proj = _linear(down.weight.data[:, cols], _first_rank(down.bias, rank))
    layer.shape = (len(kv_heads) * group, len(kv_heads), head_dim)
    layer.reduce = reduce


def _first_rank(bias: torch.Tensor | None, rank: int) -> torch.Tensor | None:
    """A bias added once to the sum over ranks: rank 0 keeps it, the others drop it."""
    return bias.data if bias is not None and rank == 0 else None


def shard_model(model: nn.Module, head_map: HeadMap, rank: int, world: int,
                reduce: Callable[[torch.Tensor], torch.Tensor],
                heads: list[list[int]] | None = None) -> list[list[int]]:  # fmt: skip
    """Shard every decoder layer of ``model`` for ``rank`` of ``world`` by ``head_map``'s
    ranks; returns the kv heads it keeps per layer, in ``heads``' order when given (e.g. a
    :class:`~headspace.parallel.placement.RankLayout`'s: own heads, then copies), else
    ascending. A head copied on several ranks keeps its
    whole weights on each; the attention callback must then attend only the copy's token
    range and scale its part by the copy's share of the log-sum-exp merge (its ``shares``),
    or the all-reduce counts the head once per copy."""
    heads = heads if heads is not None else rank_heads(head_map, rank)
    for layer, kv_heads in zip(model.layers, heads, strict=True):
        shard_layer(layer, kv_heads, rank, world, reduce)
    return heads

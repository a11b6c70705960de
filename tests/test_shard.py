"""Per-rank weight layout: ranks holding their heads' q/k/v/o rows and a slice of the MLP,
run side by side with their partial outputs summed (threads standing in for an all-reduce,
no process group), give the single model's hidden states, for uniform and uneven head maps,
copied heads (each copy a token range, merged by log-sum-exp) and biases."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from headspace.attention.reference import reference_attention
from headspace.model.config import config_from_dict
from headspace.model.llama import LlamaModel
from headspace.parallel.shard import mlp_slice, rank_heads, shard_model
from headspace.planner.head_map import HeadEntry, HeadMap

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 64,
          "intermediate_size": 90, "num_hidden_layers": 3, "num_attention_heads": 8,
          "num_key_value_heads": 4, "head_dim": 16, "rms_norm_eps": 1e-5}  # fmt: skip


class ThreadReduce:
    """An all-reduce (sum) among ``world`` threads, each passing its rank's partial."""

    def __init__(self, world: int):
        self.barrier, self.slots = threading.Barrier(world, timeout=60), [None] * world

    def for_rank(self, rank: int):
        def reduce(partial: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = partial
            self.barrier.wait()
            total = torch.stack(self.slots).sum(0)
            self.barrier.wait()  # every rank has read the slots before they are reused
            return total

        return reduce


def dense_attention(layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Causal attention of a whole prompt: q [tokens, heads, dim], kv [2, tokens, kv, dim]."""
    if q.shape[1] == 0:  # this rank holds no head of the layer
        return q
    out, _ = reference_attention(q.transpose(0, 1), kv[0].transpose(0, 1),
                                 kv[1].transpose(0, 1), causal=True)  # fmt: skip
    return out.transpose(0, 1)


def _model(seed: int = 0, **overrides) -> LlamaModel:
    torch.manual_seed(seed)
    model = LlamaModel(config_from_dict({**CONFIG, **overrides})).float().eval()
    for param in model.parameters():  # biases too: nonzero, so a doubled one shows
        torch.nn.init.normal_(param, std=0.2)
    return model


def _run_ranks(model: LlamaModel, head_map: HeadMap, world: int, ids, attention_for_rank):
    """Each rank's final hidden states, the ranks run as threads."""
    reduce, results = ThreadReduce(world), [None] * world
    shards = []
    for rank in range(world):
        shard = copy.deepcopy(model)
        heads = shard_model(shard, head_map, rank, world, reduce.for_rank(rank))
        shards.append((shard, heads))

    def run(rank: int) -> None:
        shard, heads = shards[rank]
        try:
            with torch.no_grad():
                results[rank] = shard(ids, torch.arange(len(ids)), attention_for_rank(rank, heads))
        except BaseException as error:  # noqa: BLE001 (re-raised below, after the others stop)
            results[rank] = error
            reduce.barrier.abort()  # the other ranks stop waiting for this one

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException) and not isinstance(
            result, threading.BrokenBarrierError
        ):
            raise result
    return results


def _head_map(ranks: list[list[tuple[int, ...]]]) -> HeadMap:
    entries = [HeadEntry(layer, head, rank=r) for layer, row in enumerate(ranks)
               for head, r in enumerate(row)]  # fmt: skip
    return HeadMap(len(ranks), len(ranks[0]), entries)


@pytest.mark.parametrize("world, ranks", [
    (2, [[(0,), (0,), (1,), (1,)]] * 3),  # uniform
    (2, [[(0,), (1,), (1,), (1,)], [(0,), (0,), (0,), (1,)], [(1,), (0,), (1,), (0,)]]),
    (4, [[(3,), (0,), (0,), (2,)], [(1,), (1,), (2,), (3,)], [(0,), (1,), (2,), (3,)]]),
    (4, [[(0,), (0,), (0,), (0,)], [(1,), (1,), (1,), (1,)], [(2,), (3,), (2,), (3,)]]),
])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_ranks_with_their_heads_equal_the_whole_model(world, ranks, bias):
    model = _model(attention_bias=bias, mlp_bias=bias)
    ids = torch.randint(0, 97, (23,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids, torch.arange(23), dense_attention)
    head_map = _head_map(ranks)
    results = _run_ranks(model, head_map, world, ids, lambda rank, heads: dense_attention)
    for hidden in results:
        torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
    for rank in range(world):  # each rank holds only its heads' rows and its MLP slice
        shard = copy.deepcopy(model)
        shard_model(shard, head_map, rank, world, lambda t: t)
        for layer, held in zip(shard.layers, rank_heads(head_map, rank), strict=True):
            width = len(held) * 16  # kv heads x head_dim; two query heads per kv head
            assert layer.qkv_proj.weight.shape == (4 * width, 64)  # q twice, k, v
            assert layer.o_proj.weight.shape == (64, 2 * width)
            mlp_width = len(range(90)[mlp_slice(90, rank, world)])
            assert layer.down_proj.weight.shape == (64, mlp_width)
            assert (layer.o_proj.bias is not None) == (bias and rank == 0)


def test_a_copied_head_splits_its_tokens_and_merges_by_lse():
    """Head 0 of every layer on both ranks: rank 0 attends its first 10 keys, rank 1 the
    rest; the ranks exchange the copy's lse and each scales its part by its share of the
    merge, so o_proj's all-reduce sums the merged output."""
    world, split, num_tokens = 2, 10, 23
    model = _model(seed=3)
    ids = torch.randint(0, 97, (num_tokens,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids, torch.arange(num_tokens), dense_attention)
    head_map = _head_map([[(0, 1), (0,), (1,), (1,)]] * 3)
    exchange = ThreadReduce(world)

    def attention_for_rank(rank: int, heads: list[list[int]]):
        def attention(layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
            out = dense_attention(layer, q, kv)
            group = q.shape[1] // kv.shape[2]
            local = heads[layer].index(0)  # the copy's kv head, then its query heads
            rows = slice(local * group, (local + 1) * group)
            keys = slice(0, split) if rank == 0 else slice(split, num_tokens)
            mask = torch.zeros(group, num_tokens, num_tokens, dtype=torch.bool)
            mask[:, :, keys] = True
            part, lse = reference_attention(
                q[:, rows].transpose(0, 1), kv[0, :, local : local + 1].transpose(0, 1),
                kv[1, :, local : local + 1].transpose(0, 1), causal=True, mask=mask,
            )  # fmt: skip
            gather = exchange.for_rank(rank)  # both copies' lse, gathered through sums
            lses = [gather(lse if r == rank else torch.zeros_like(lse)) for r in range(world)]
            total = torch.logsumexp(torch.stack(lses), 0)  # over the copies' key ranges
            weight = torch.exp(lse - total).nan_to_num(0.0)  # this copy's share of the merge
            out = out.clone()  # the copy's weighted part: o_proj and the all-reduce sum them
            out[:, rows] = (part * weight[..., None]).transpose(0, 1)
            return out

        return attention

    results = _run_ranks(model, head_map, world, ids, attention_for_rank)
    for hidden in results:
        torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)


def test_mlp_slices_cover_the_columns_once():
    for inter in (90, 7, 14336):
        for world in (1, 2, 3, 4, 8):
            cols = [i for r in range(world) for i in range(inter)[mlp_slice(inter, r, world)]]
            assert cols == list(range(inter))


def _gloo_rank(rank: int, world: int, store: str, model_path: str, result_path: str) -> None:
    """One process of the gloo test: its shard of the saved model, summed over processes."""
    import torch.distributed as dist

    from headspace.parallel.dist import all_reduce_sum

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model, head_map, ids = torch.load(model_path, weights_only=False)
    shard_model(model, head_map, rank, world, all_reduce_sum)
    with torch.no_grad():
        hidden = model(ids, torch.arange(len(ids)), dense_attention)
    torch.save(hidden, f"{result_path}.{rank}")
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_processes_with_their_heads_equal_the_whole_model(world, tmp_path):
    """The same through torch.distributed (gloo, one process per rank), uneven heads."""
    import torch.multiprocessing as mp

    model = _model(seed=5)
    ids = torch.randint(0, 97, (19,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(ids, torch.arange(19), dense_attention)
    uneven = {
        2: [[0, 0, 0, 1], [1, 1, 0, 1], [0, 1, 1, 1]],  # 3 + 1 heads, 1 + 3, ...
        4: [[0, 0, 1, 3], [3, 3, 3, 3], [2, 1, 0, 2]],  # ranks with no head of a layer
    }
    ranks = [[(rank,) for rank in layer] for layer in uneven[world]]
    torch.save((model, _head_map(ranks), ids), tmp_path / "model.pt")
    mp.spawn(_gloo_rank, args=(world, str(tmp_path / "store"), str(tmp_path / "model.pt"),
                               str(tmp_path / "hidden")), nprocs=world)  # fmt: skip
    for rank in range(world):
        hidden = torch.load(tmp_path / f"hidden.{rank}")
        torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)


def test_layers_sharded_as_they_load_equal_the_model_sharded_after(embedded_dir):
    """Loading with ``keep`` (each layer sharded in host memory as it loads, then moved)
    gives the weights of the whole model loaded and sharded afterwards, layer by layer."""
    from headspace.model.loader import load_model
    from headspace.parallel.shard import shard_layer

    heads = [[2, 0], [1], [0, 1, 2]]  # any order, any count: the rank's weight order

    def keep(index: int, layer) -> None:
        seen.append(index)
        shard_layer(layer, heads[index % 3], 1, 2, lambda t: t)

    seen: list[int] = []
    loaded = load_model(embedded_dir, keep=keep)
    whole = load_model(embedded_dir)
    for index, layer in enumerate(whole.layers):
        shard_layer(layer, heads[index % 3], 1, 2, lambda t: t)
    assert seen == list(range(whole.config.num_layers))
    mine, theirs = dict(loaded.named_parameters()), dict(whole.named_parameters())
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[name], theirs[name]) for name in mine)
    assert loaded.layers[1].qkv_proj.weight.shape[0] < whole.config.hidden_size


@pytest.mark.parametrize(
    "pinned,machine,ranks_here,cores",
    [(16, 16, 1, 16), (16, 16, 4, 4), (4, 16, 4, 4), (3, 16, 2, 3), (2, 2, 4, 1)],
)
def test_ranks_divide_the_machines_cores_unless_bound_to_their_own(pinned, machine, ranks_here,
                                                                    cores):  # fmt: skip
    """The hybrid tier's CPU threads: a rank bound to part of the machine keeps its cores
    (they are its own); ranks sharing the whole machine divide it, one core at least."""
    from headspace.parallel.launch import rank_cores

    assert rank_cores(pinned, machine, ranks_here) == cores

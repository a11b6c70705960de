"""Head-parallel ranks on GPUs against one process, launched as users launch them
(torchrun): gloo ranks sharing one GPU, NCCL ranks on a GPU each (run on a GPU machine; CI
has none)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _one_and_ranks(tmp_path, world: int, *args: str) -> tuple[dict, dict]:
    """``tests/workers/parallel_gpu.py ARGS`` in one process (no process group, everything
    resident), then under torchrun with ``world`` ranks: (the single process's results,
    rank 0's)."""
    gc.collect()  # the engines of earlier tests (cycles hold some), then the cached blocks:
    torch.cuda.empty_cache()  # four ranks on this GPU need its memory
    worker = Path(__file__).parent / "workers" / "parallel_gpu.py"
    one, many = tmp_path / "one.pt", tmp_path / "many.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    alone = [*args[:2], "gloo", *args[3:]]  # the ranks' options but no process group
    done = subprocess.run([sys.executable, str(worker), str(one), *alone], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={world}", str(worker), str(many), *args],
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(one), torch.load(many)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("balance,kv_budget", [("greedy", ""), ("fairkv", ""), ("fairkv", "0.5")])
def test_ranks_over_two_gpus_equal_one_process(tmp_path, balance, kv_budget):
    """Two GPUs through NCCL, as torchrun launches them: fp32 logits and greedy tokens of one
    process; decode steps run as CUDA graphs with the all-reduces captured (this config's
    two kv heads balance without copies on two ranks, so no copy runs in a graph here)."""
    ref, got = _one_and_ranks(tmp_path, 2, balance, kv_budget, "nccl")
    assert got["graphs"]
    assert (got["logits"] - ref["logits"]).abs().max().item() <= 1e-4
    assert got["tokens"] == ref["tokens"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("kv_budget", ["", "0.5"])
def test_copies_in_graphs_over_two_gpus_equal_one_process(tmp_path, kv_budget):
    """Two GPUs through NCCL over three kv heads: fairkv copies one head a layer, so the
    decode graphs capture the copies' key ranges cut in the kernel, their lse all-gather
    and the compiled merge; logits and tokens of one process."""
    ref, got = _one_and_ranks(tmp_path, 2, "fairkv", kv_budget, "nccl", "", "3")
    assert got["graphs"] and "4 entries copied" in got["summary"]
    assert (got["logits"] - ref["logits"]).abs().max().item() <= 1e-4
    assert got["tokens"] == ref["tokens"]


@pytest.mark.parametrize(
    "world,balance,kv_budget,backend",
    [(2, "uniform", "", "gloo"), (4, "fairkv", "", "gloo"), (4, "fairkv", "0.5", "gloo"),
     (4, "greedy", "", "gloo-twin"), (4, "fairkv", "0.5", "gloo-twin")],
)  # fmt: skip
def test_ranks_on_gpu_equal_one_process(tmp_path, world, balance, kv_budget, backend):
    """Head-parallel ranks sharing the GPU (gloo) give the single process's fp32 logits and
    greedy tokens: the Triton decode kernel over each copy's key range (fairkv on 4 ranks
    copies both kv heads), the fused prefill over each copy's rows; under Ada-SnapKV, the
    per-entry kernel over each copy's range of the kept tokens. Through the graphs' twin the
    decode steps run the graphs' compiled static blocks on sharded layers (greedy on 4
    ranks leaves two of them no head in a layer)."""
    ref, got = _one_and_ranks(tmp_path, world, balance, kv_budget, backend)
    assert got["graphs"] == (backend == "gloo-twin")
    assert (got["logits"] - ref["logits"]).abs().max().item() <= 1e-4
    assert got["tokens"] == ref["tokens"]


@pytest.mark.parametrize(
    "offload,backend,kv_budget",
    [("head", "gloo", ""), ("hybrid", "gloo", ""), ("head", "gloo-twin", ""),
     ("head", "gloo", "0.5")],
)  # fmt: skip
def test_ranks_streaming_from_host_memory_equal_one_process(tmp_path, offload, backend,
                                                            kv_budget):  # fmt: skip
    """Two ranks sharing the GPU, each streaming its heads from its pinned host pages
    (Triton gathers on the copy stream; hybrid: CPU threads on the older tokens), give the
    fp32 logits and tokens of one process keeping everything resident; through the graphs'
    twin the streamed history is gathered as a graph's step does (one kernel, its page
    count on the device). Under Ada-SnapKV each rank's offloaded entries are compressed in
    its host pages and stream only what they keep, on the copy stream."""
    ref, got = _one_and_ranks(tmp_path, 2, "uniform", kv_budget, backend, offload)
    assert got["offloaded"] > 0 and ref["offloaded"] == 0
    assert got["graphs"] == (backend == "gloo-twin")
    assert (got["logits"] - ref["logits"]).abs().max().item() <= 1e-4
    assert got["tokens"] == ref["tokens"]


def test_ranks_swapping_sequences_equal_one_process(tmp_path):
    """Two ranks sharing the GPU, four sequences outgrowing each rank's all-resident pool as
    they generate: sequences swap out to the ranks' host pages and back (every rank alike),
    and give the fp32 logits and tokens of one process that never swaps."""
    ref, got = _one_and_ranks(tmp_path, 2, "uniform", "", "gloo", "swap")
    assert sum(ref["swaps"]) == 0 and sum(got["swaps"]) > 0, (ref["swaps"], got["swaps"])
    assert (got["logits"] - ref["logits"]).abs().max().item() <= 1e-4
    assert got["tokens"] == ref["tokens"]

"""torch.distributed glue: the process group from torchrun's environment (NCCL on GPUs, gloo
on the CPU) and the sum over ranks that a sharded layer's ``reduce`` calls."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_from_env(device: str = "cpu") -> tuple[int, int]:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``);
    returns ``(rank, world)``, ``(0, 1)`` outside torchrun. A GPU rank uses the device of its
    ``LOCAL_RANK``."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def all_reduce_sum(partial: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's ``partial`` (same shape everywhere), in place."""
    dist.all_reduce(partial, op=dist.ReduceOp.SUM)
    return partial

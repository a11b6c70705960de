"""torch.distributed glue: the process group from torchrun's environment (NCCL on GPUs, gloo
on the CPU) and the sum over ranks that a sharded layer's ``reduce`` calls."""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

# what must go before the process group does (weak references: a runner that is gone is
# passed over)
_RELEASES: list[weakref.WeakMethod] = []


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
        atexit.register(leave)
    return dist.get_rank(), dist.get_world_size()


def release_before_leaving(release: Callable[[], None]) -> None:
    """Call ``release`` (a bound method, held weakly) before the process group is destroyed
    at exit. CUDA graphs that captured NCCL collectives must be released first: destroying
    the group while they exist hangs the process (NCCL waits on the graphs' resources; a
    known PyTorch issue, pytorch/pytorch#115388)."""
    _RELEASES[:] = [ref for ref in _RELEASES if ref() is not None]  # of objects still here
    _RELEASES.append(weakref.WeakMethod(release))


def leave() -> None:
    """Release what :func:`release_before_leaving` registered, then destroy the process
    group (at exit; a program may call it sooner)."""
    global _CPU_GROUP
    try:
        while _RELEASES:
            release = _RELEASES.pop(0)()
            if release is not None:
                release()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _CPU_GROUP = None


def all_reduce_sum(partial: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's ``partial`` (same shape everywhere), in place."""
    dist.all_reduce(partial, op=dist.ReduceOp.SUM)
    return partial


def rank_zero_first(work):
    """``work()`` on rank 0, then on the others (e.g. a conversion the others then find
    done); just ``work()`` outside a process group."""
    if not dist.is_initialized():
        return work()
    if dist.get_rank() == 0:
        result = work()
        dist.barrier()
        return result
    dist.barrier()
    return work()


def all_gather_stack(part: torch.Tensor) -> torch.Tensor:
    """Every rank's ``part`` (same shape everywhere), stacked: ``[world, *part.shape]``
    (NCCL gathers into the stack itself: one collective, no copies after it)."""
    if dist.get_backend() == "nccl":
        stacked = part.new_empty(dist.get_world_size(), *part.shape)
        dist.all_gather_into_tensor(stacked, part.contiguous())
        return stacked
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, part.contiguous())
    return torch.stack(parts)


_CPU_GROUP = None


def _cpu_group():
    """A gloo group of every rank, for small host-side agreements (no GPU work waits)."""
    global _CPU_GROUP
    if _CPU_GROUP is None:
        _CPU_GROUP = dist.new_group(backend="gloo")
    return _CPU_GROUP


def host_min(value: int) -> int:
    """The smallest of every rank's ``value``, over a gloo group of the host (no GPU work
    waits on it)."""
    tensor = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=_cpu_group())
    return int(tensor.item())


def first_error(message: str | None) -> str | None:
    """The lowest rank's error ``message`` of those given (None where a rank had none), the
    same on every rank: each raises it, so all stop alike (see :func:`host_min`)."""
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message, group=_cpu_group())
    return next((m for m in messages if m is not None), None)


def all_agree(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (see :func:`host_min`)."""
    return bool(host_min(int(ok)))


def broadcast_object(obj, src: int = 0, host: bool = False):
    """Rank ``src``'s ``obj`` (picklable), on every rank; ``host``: over the gloo group of
    the host (no GPU work waits on it)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_cpu_group() if host else None)
    return box[0]


def broadcast_(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank ``src``'s ``tensor`` copied into every rank's, in place."""
    dist.broadcast(tensor, src=src)
    return tensor

"""What torchrun's environment says about this process, without torch (the command line
reads it before deciding whether to import any): its rank, the ranks on this machine, and
the CPU cores that are its own."""

from __future__ import annotations

import os


def local_world_size() -> int:
    """The ranks torchrun started on this machine (``LOCAL_WORLD_SIZE``; 1 outside it):
    they share its memory and cores."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def rank_cores(pinned: int | None = None, machine: int | None = None,
               ranks_here: int | None = None) -> int:  # fmt: skip
    """CPU cores this process may use: the ``pinned`` cores of its affinity mask where the
    launcher bound it to part of the ``machine``'s cores (they are its own already), else
    the machine's divided among the ``ranks_here`` on it (defaults: this process's)."""
    pinned = len(os.sched_getaffinity(0)) if pinned is None else pinned
    machine = (os.cpu_count() or pinned) if machine is None else machine
    ranks_here = local_world_size() if ranks_here is None else ranks_here
    if pinned < machine:
        return pinned
    return max(1, pinned // ranks_here)


def is_first_rank() -> bool:
    """Whether this process is rank 0 of torchrun's (or the only process): the one that
    writes output."""
    return int(os.environ.get("RANK", "0")) == 0


def visible_gpus(driver: str = "/proc/driver/nvidia/gpus") -> int:
    """NVIDIA GPUs this process may see, read without CUDA (a directory a GPU in the
    ``driver``'s entries, as many as ``CUDA_VISIBLE_DEVICES`` names at most): what the
    command line's help lists flags by, where importing torch would take seconds."""
    try:
        present = len(os.listdir(driver))
    except OSError:
        return 0
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is None:
        return present
    listed = 0  # (CUDA reads the list up to its first entry that names no device)
    for entry in (e.strip() for e in named.split(",")):
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        listed += 1
    return min(present, listed)

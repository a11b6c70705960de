"""Memory budgets: parse ``gpu_memory`` and size the KV page pool from it."""

from __future__ import annotations

import os
import re

import torch

from headspace.errors import UserError
from headspace.model.config import ModelConfig

CPU_PREFILL_CHUNK = 1024

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_memory(value: str | float | int, total_bytes: int) -> int:
    """Bytes from ``"24GiB"``, ``"500MB"``, a byte count, or a fraction in (0, 1] of the total."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if 0 < value <= 1:
            return int(value * total_bytes)
        if value > 1:
            return int(value)
        raise UserError(f"memory budget must be positive, got {value}")
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).upper() not in _UNITS:
        raise UserError(f"cannot read memory budget {value!r} (use e.g. 24GiB, 500MB or 0.8)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return parse_memory(number, total_bytes) if unit == "" else int(number * _UNITS[unit])


def device_total_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_budget(value: str | float | None) -> int:
    """Host bytes for streamed KV: the user's budget (fractions of total RAM), else 90% of
    the memory available now (a plan must not push the machine into swap)."""
    total = device_total_bytes(torch.device("cpu"))
    if value is not None:
        return parse_memory(value, total)
    try:
        with open("/proc/meminfo") as meminfo:  # counts reclaimable page cache as available
            fields = dict(line.split(":", 1) for line in meminfo)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux: what is free, else the total
        try:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (OSError, ValueError):
            available = total
    return int(0.9 * available)


def kv_page_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    return (
        2 * config.num_layers * config.num_kv_heads * config.head_dim * page_size * dtype.itemsize
    )


def gpu_budget(engine_config, weight_bytes: int) -> int | None:
    """Bytes the engine may hold on its device: the user's budget, else on a GPU the weights
    plus what is free now; None on the CPU without a budget."""
    device = torch.device(engine_config.device)
    if engine_config.gpu_memory is not None:
        return parse_memory(engine_config.gpu_memory, device_total_bytes(device))
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] + weight_bytes
    return None


def num_kv_pages(
    config: ModelConfig,
    budget: str | float | None,
    *,
    device: torch.device,
    dtype: torch.dtype,
    page_size: int,
    weight_bytes: int,
    activation_bytes: int,
    max_context: int,
) -> int:
    """Pages of the KV pool: what the budget leaves after weights and activations.

    Without a budget: 90% of free GPU memory on a GPU; on the CPU, room for four full
    contexts. Raises UserError when the budget leaves no room for one full page.
    """
    page_bytes = kv_page_bytes(config, page_size, dtype)
    if budget is None:
        if device.type != "cuda":
            return 4 * -(-max_context // page_size)
        free, _ = torch.cuda.mem_get_info(device)
        return max(0, int(0.9 * free) - activation_bytes) // page_bytes
    total = parse_memory(budget, device_total_bytes(device))
    left = total - weight_bytes - activation_bytes
    if left < page_bytes:
        raise UserError(
            f"memory budget too small: {total / 2**30:.2f} GiB holds weights "
            f"({weight_bytes / 2**30:.2f} GiB) and activations ({activation_bytes / 2**30:.2f} "
            f"GiB) but no KV page ({page_bytes / 2**20:.1f} MiB each)"
        )
    return left // page_bytes


def prefill_chunk_size(config: ModelConfig, engine_config, weight_bytes: int,
                       max_context: int) -> int:  # fmt: skip
    """Prompt tokens per prefill step: the user's choice, else what fits the device
    (``weight_bytes`` in bytes, ``max_context`` in tokens).

    On a GPU a power of two (full chunks share one compiled shape across prompts) whose
    activations take a fifth of what the budget (or free memory) leaves after weights.
    """
    if engine_config.prefill_chunk:
        return engine_config.prefill_chunk
    if not engine_config.on_gpu:
        return CPU_PREFILL_CHUNK
    from headspace.planner.plan import prefill_chunk

    room = gpu_budget(engine_config, weight_bytes) - weight_bytes
    return prefill_chunk(config, room, max_context, engine_config.torch_dtype.itemsize)


def offload_plan(config: ModelConfig, engine_config, weight_bytes: int, max_context: int):
    """The planner's plan (head map, prefill chunk) when some kv heads must (or are asked
    to) stream from host memory for ``max_context`` tokens; None when every head stays
    resident."""
    from headspace.planner import PlanRequest, make_plan

    if engine_config.offload == "none":
        return None
    gpu = gpu_budget(engine_config, weight_bytes)
    if gpu is None:  # no budget on the CPU: everything stays in (host) memory
        return None
    host = host_budget(engine_config.host_memory)
    request = PlanRequest(max_context, gpu, host, engine_config.torch_dtype.itemsize,
                          engine_config.offload, engine_config.head_group,
                          engine_config.prefill_chunk)  # fmt: skip
    plan = make_plan(config, request)
    return plan if plan.head_map.count("stream") else None

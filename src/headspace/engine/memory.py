"""Memory budgets: parse ``gpu_memory`` / ``host_memory`` and size the KV arena from them
with the planner's arithmetic (one source for the planner and the pools)."""

from __future__ import annotations

import os
import re
from dataclasses import replace

import torch

from headspace.errors import UserError
from headspace.kv.spec import KVSpec, byte_size
from headspace.model.config import ModelConfig
from headspace.planner.memory import prefill_chunk, split_gpu_budget
from headspace.planner.sparsity import arena_after_gathers, prefill_gathers

CPU_PREFILL_CHUNK = 1024
FLEX_INDEX_LIMIT = 2**31 - 1  # elements of a K tensor FlexAttention's kernels index in int32
FREE_MEMORY_SHARE = 0.9  # of what is free on the GPU, without a budget

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def read_memory(value: str) -> tuple[float, str]:
    """(number, unit) of a budget as text: ``"24GiB"``, ``"500MB"``, a byte count or a
    fraction in (0, 1]; UserError for anything else (a bare number above 1 is bytes, so it
    must be whole)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if match and match.group(2).upper() in _UNITS:
        number, unit = float(match.group(1)), match.group(2).upper()
        if number > 0 and (unit or number <= 1 or number.is_integer()):
            return number, unit
    raise UserError(
        f"cannot read {value!r} as a memory budget: give a positive size such as "
        f"24GiB or 500MB, whole bytes, or a fraction such as 0.8"
    )


def parse_memory(value: str | float | int, total_bytes: int) -> int:
    """Bytes from ``"24GiB"``, ``"500MB"``, a byte count, or a fraction in (0, 1] of the total."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if 0 < value <= 1:
            return int(value * total_bytes)
        if value > 1 and float(value).is_integer():
            return int(value)
        raise UserError(f"memory budget must be a fraction in (0, 1] or whole bytes, got {value}")
    number, unit = read_memory(value)
    return parse_memory(number, total_bytes) if unit == "" else int(number * _UNITS[unit])


def device_total_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_budget(value: str | float | None) -> int:
    """Host bytes for KV pages: the user's budget (fractions of total RAM), else 90% of
    the memory available now (a plan must not push the machine into swap)."""
    if value is not None:
        return parse_memory(value, device_total_bytes(torch.device("cpu")))
    return int(0.9 * available_host_bytes())


def available_host_bytes() -> int:
    """Host memory available now (reclaimable page cache counted; else what is free, else
    the total)."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):  # not Linux
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (OSError, ValueError):
            return device_total_bytes(torch.device("cpu"))


def rank_host_bytes(value: str | float | None, ranks_on_host: int = 1,
                    unloaded_weight_bytes: int = 0) -> int:  # fmt: skip
    """One rank's host bytes for KV pages, as the engine sizes them and ``plan`` predicts:
    :func:`host_budget` of ``value``, less (with no budget given) ``unloaded_weight_bytes``
    of decoder layers that will stream from host memory but are not loaded yet (a plan made
    without the model; the engine measures after loading them), divided between the
    ``ranks_on_host`` ranks of the machine (the engine then leaves room in it for the sparse
    mode's key boxes, which ``plan`` does not model). UserError when the layers leave
    nothing."""
    budget = host_budget(value)
    if value is None and unloaded_weight_bytes:
        if unloaded_weight_bytes >= budget:
            raise UserError(f"host memory too small: the streamed layers need "
                            f"{byte_size(unloaded_weight_bytes)} of the {byte_size(budget)} "
                            f"available")  # fmt: skip
        budget -= unloaded_weight_bytes
    return budget // ranks_on_host


def gpu_budget(engine_config, weight_bytes: int) -> int | None:
    """Bytes the engine may hold on its device: the user's budget, else on a GPU the weights
    plus 90% of what is free now (:func:`default_gpu_budget`); None on the CPU without a
    budget. An engine reads it from a config that :func:`with_gpu_budget` resolved once."""
    device = torch.device(engine_config.runtime.device)
    if engine_config.cache.gpu_memory is not None:
        return parse_memory(engine_config.cache.gpu_memory, device_total_bytes(device))
    if device.type == "cuda":
        return default_gpu_budget(device, weight_bytes)
    return None


def default_gpu_budget(device: torch.device, weight_bytes: int = 0, to_load: int = 0) -> int:
    """Without a budget given, what an engine made now on the GPU ``device`` may hold: its
    weights (``weight_bytes`` on the device, ``to_load`` still to be loaded) plus 90% of
    the memory free once they are there (``plan`` reads the same)."""
    free = torch.cuda.mem_get_info(device)[0] - to_load
    return int(FREE_MEMORY_SHARE * max(free, 0)) + weight_bytes + to_load


def with_gpu_budget(engine_config, weight_bytes: int, to_load: int = 0):
    """``engine_config`` with its GPU budget resolved to bytes once (the user's, else
    :func:`default_gpu_budget` of ``weight_bytes`` on the device and ``to_load`` still to
    load): the free memory sampled when the engine is made, not again as its parts are
    sized (each after the last one's allocations)."""
    if engine_config.cache.gpu_memory is not None or not engine_config.runtime.on_gpu:
        return engine_config
    device = torch.device(engine_config.runtime.device)
    budget = default_gpu_budget(device, weight_bytes, to_load)
    return replace(engine_config, cache=replace(engine_config.cache, gpu_memory=budget))


def check_host_room(arena_bytes: int) -> None:
    """On the CPU, where the GPU memory budget is host memory: UserError when its KV arena
    of ``arena_bytes`` passes the host memory available (the kernel would kill the process
    part-way through instead)."""
    available = available_host_bytes()
    if arena_bytes > available:
        raise UserError(
            f"on the CPU the GPU memory budget is host memory: its KV arena of "
            f"{byte_size(arena_bytes)} is more than the {byte_size(available)} available "
            f"(lower --gpu-memory / gpu_memory)"
        )


def prefill_chunk_size(config: ModelConfig, engine_config, weight_bytes: int,
                       max_context: int, streamed: bool = False) -> int:  # fmt: skip
    """Prompt tokens per prefill step: the user's choice, else what fits the budget (on a
    GPU, or on the CPU with a budget; 1024 on the CPU without one); ``weight_bytes`` on the
    device, the layers ``streamed`` from the host or not."""
    if engine_config.runtime.prefill_chunk:
        return engine_config.runtime.prefill_chunk
    budget = gpu_budget(engine_config, weight_bytes)
    if budget is None:
        return CPU_PREFILL_CHUNK
    return prefill_chunk(config, budget - weight_bytes, max_context,
                         engine_config.runtime.torch_dtype.itemsize, streamed=streamed)  # fmt: skip


def attention_prefix(config: ModelConfig) -> int:
    """The prefix (tokens) at which a prompt token's attention in a layer (scores and
    weighted values over the keys before it: 4 x heads x head_dim FLOPs a key) costs as
    many FLOPs as its linear layers there (q/k/v, o, gate/up and down projections): 26,624
    for Llama-3.1-8B. The scheduler sizes a step's layers of a prompt chunk by it."""
    c = config
    qkv = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    linear = 2 * (qkv + c.num_heads * c.head_dim * c.hidden_size
                  + 3 * c.hidden_size * c.intermediate_size)  # fmt: skip
    return max(1, round(linear / (4 * c.num_heads * c.head_dim)))


def decode_rates(config: ModelConfig, itemsize: int, prompt_flops: float,
                 hbm_bytes: float) -> tuple[float, float]:  # fmt: skip
    """A decode step's reads in prompt work (a prompt token through one layer's linear
    layers = 1) where a prompt runs at ``prompt_flops`` (its linear layers' FLOPs a second,
    the whole forward's pace: ``Hardware.prompt_flops``) and HBM reads ``hbm_bytes`` a
    second: (a layer's weights read once, one context token's K/V in a layer). Llama-3.1-8B
    in bf16 on the planner's H100 rates: 165 and 0.0016 (a decode step of 16 requests at
    4.5K tokens: as long as 280 prompt tokens through every layer)."""
    c = config
    kv_bytes = 2 * c.num_kv_heads * c.head_dim * itemsize  # a token's K and V in a layer
    linear_seconds = 4 * attention_prefix(config) * c.num_heads * c.head_dim / prompt_flops
    return itemsize * prompt_flops / (2 * hbm_bytes), kv_bytes / hbm_bytes / linear_seconds


def kv_arena_bytes(config: ModelConfig, engine_config, spec: KVSpec, weight_bytes: int,
                   chunk: int, max_context: int) -> int:  # fmt: skip
    """Bytes of the KV arena: ``num_kv_pages`` all-resident pages (+1 scratch) when given;
    else what the budget leaves after weights, a chunk's activations with allocator slack,
    batched decode, and with patterns or budgets the keys a layer's prefill gathers
    (UserError when nothing is left); on the CPU without a budget, room for four full
    contexts within half the host memory available now. Under the ``flex`` backend, at most
    :func:`flex_pool_pages` pages (per-entry pages: ``FLEX_INDEX_LIMIT`` elements of K)."""
    arena = _arena_bytes(config, engine_config, spec, weight_bytes, chunk, max_context)
    if engine_config.runtime.attention_backend != "flex":
        return arena
    if engine_config.prompt_gathers() is not None:  # per-entry pages: one plane of them all
        most = FLEX_INDEX_LIMIT // (spec.head_dim * spec.page_size) * spec.entry_page_bytes
    else:
        most = (flex_pool_pages(spec) + 1) * spec.full_page_bytes
    asked = engine_config.cache.num_kv_pages
    if asked and arena > most:
        raise UserError(f"--num-kv-pages {asked} is more than the flex attention backend "
                        f"indexes ({most // spec.full_page_bytes - 1} pages); ask for fewer "
                        "or use --attention-backend sdpa")  # fmt: skip
    return min(arena, most)


def flex_pool_pages(spec: KVSpec) -> int:
    """The most pages a layer's pool holds under the ``flex`` backend: its K plane ``[kv
    heads, slots, dim]`` within int32 indices (past them, torch 2.11 fails to compile the
    int64 decode kernel), counted for every kv head, whatever a layer holds. Two million
    tokens for Llama-3.1-8B's 8 kv heads of 128, far past one GPU's memory; tiny models on
    a large GPU reach it. Per-entry pages (budgets) share one plane: at most
    ``FLEX_INDEX_LIMIT`` elements of K in all (8 GiB of bf16 K/V)."""
    return FLEX_INDEX_LIMIT // (spec.num_kv_heads * spec.head_dim * spec.page_size) - 1


def _arena_bytes(config: ModelConfig, engine_config, spec: KVSpec, weight_bytes: int,
                 chunk: int, max_context: int) -> int:  # fmt: skip
    if engine_config.cache.num_kv_pages:
        return (engine_config.cache.num_kv_pages + 1) * spec.full_page_bytes
    budget = gpu_budget(engine_config, weight_bytes)
    if budget is None:  # the arena is host memory: at most half of what is available
        contexts = (4 * spec.pages_for(max_context) + 1) * spec.full_page_bytes
        return min(contexts, host_budget(None) // 2 // spec.full_page_bytes * spec.full_page_bytes)
    split = split_gpu_budget(config, budget, weight_bytes, chunk, spec.dtype_bytes,
                             engine_config.runtime.max_batch)  # fmt: skip
    gathers = engine_config.prompt_gathers()
    if gathers is not None:
        budgets, pattern = gathers
        gathered = prefill_gathers(spec.num_kv_heads, config.num_queries_per_kv, spec.head_dim,
                                   spec.dtype_bytes, max_context, chunk, budgets=budgets,
                                   pattern=pattern)  # fmt: skip
        return arena_after_gathers(split.arena, gathered, max_context)
    return split.arena

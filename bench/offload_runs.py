"""One measured run per system for the offload benchmark: headspace (none / layer / head) and
transformers (standard cache, or DynamicCache(offloading=True)), each as prefill + decode.

A run that cannot fit reports ``ok: False`` and why (out of GPU memory, out of pages, or the
planner's refusal), so maximum-context ladders can stop at the first failure.
"""

from __future__ import annotations

import contextlib
import gc
import time

import torch

from common import LLAMA3_8B, batch_engine, cuda_time, prefill_once
from headspace.engine.config import EngineConfig
from headspace.errors import UserError
from headspace.kv.page_pool import OutOfPages

GiB = 2**30


@contextlib.contextmanager
def gpu_cap(cap_gib: float | None):
    """Cap this process's CUDA allocations at ``cap_gib`` (None: the whole GPU)."""
    total = torch.cuda.get_device_properties(0).total_memory
    if cap_gib is not None:
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GiB / total))
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def _fresh_peak() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()


def _peaks() -> dict:
    return {
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / GiB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GiB,
    }


def _failure(error: Exception) -> dict:
    reason = "out of GPU memory" if isinstance(error, torch.OutOfMemoryError) else str(error)
    return {"ok": False, "error": reason.splitlines()[0][:300]}


def headspace_run(model, length: int, offload: str, budget: str | None, steps: int) -> dict:
    """Prefill ``length`` random tokens, then ``steps`` decode steps, timed separately."""
    try:
        return _headspace_run(model, length, offload, budget, steps)
    except (torch.OutOfMemoryError, UserError, OutOfPages) as error:
        return {**_failure(error), "budget": budget}
    finally:
        _fresh_peak()


def _headspace_run(model, length, offload, budget, steps) -> dict:
    from headspace.engine.scheduler import Sequence

    max_context = length + steps + 8
    config = EngineConfig(device="cuda", offload=offload, gpu_memory=budget,
                          max_context=max_context, prefix_caching=False)  # fmt: skip
    engine = batch_engine(model, config, max_context=max_context)
    runner, plan = engine.runner, engine.plan
    ids = torch.randint(0, LLAMA3_8B["vocab_size"], (length,)).tolist()
    warmup = min(length, 2 * engine.chunk)
    prefill_once(engine, ids[:warmup])  # compiles the chunk and prefix shapes
    seq = Sequence(1, ids, max_context)
    runner.blocks.allocate_prompt(seq.seq_id, ids, reuse=False)
    _fresh_peak()
    start = time.perf_counter()
    logits = runner.prefill(seq, engine.chunk)
    seq.output_ids.append(int(logits.argmax()))
    prefill_s = time.perf_counter() - start
    runner.decode([seq])  # warm-up step (compiles the decode shape)
    seq.output_ids.append(1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        seq.output_ids.append(int(runner.decode([seq])[0].argmax()))
    decode_s = (time.perf_counter() - start) / steps
    row = {
        "ok": True, "prefill_tok_s": length / prefill_s, "prefill_s": prefill_s,
        "decode_ms": 1000 * decode_s, "decode_steps": steps, "prefill_chunk": engine.chunk,
        **_peaks(), "budget": budget,
        "head_map": plan.head_map.summary() if plan else "all resident",
        "streamed_bytes_per_token": plan.memory["host_kv"] if plan else 0,
        "planned_gpu_gib": plan.memory["total_gpu"] / GiB if plan else None,
        "predicted_prefill_tok_s": plan.prefill_tok_s if plan else None,
        "host_store_gib": runner.streamer.host.num_bytes / GiB if runner.streamer else 0.0,
    }  # fmt: skip
    runner.blocks.free(seq.seq_id)
    return row


@torch.inference_mode()
def transformers_run(hf, length: int, offloading: bool, steps: int) -> dict:
    """``generate`` of ``steps`` tokens after ``length`` random tokens; DynamicCache with
    ``offloading`` moves every layer's K/V to host memory between uses (layer offload)."""
    from transformers import DynamicCache

    ids = torch.randint(0, LLAMA3_8B["vocab_size"], (1, length), device="cuda")
    _fresh_peak()
    try:
        cache = DynamicCache(config=hf.config, offloading=offloading)
        start = time.perf_counter()
        out = hf.generate(ids, past_key_values=cache, max_new_tokens=steps, min_new_tokens=steps,
                          do_sample=False)  # fmt: skip
        torch.cuda.synchronize()
        assert out.shape[1] == length + steps
        return {"ok": True, "seconds": time.perf_counter() - start, **_peaks()}
    except torch.OutOfMemoryError as error:
        return _failure(error)
    finally:
        _fresh_peak()


def compute_rates() -> dict:
    """Measured bf16 GEMM FLOP/s (a Llama-3-8B MLP GEMM, 8192 tokens) and causal attention
    FLOP/s (the engine's cuDNN path, 32 heads over 8 kv heads, 16K tokens): the compute
    roofline of prefill."""
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
    gemm = 2 * 8192 * 4096 * 14336 / cuda_time(lambda: a @ b, warmup=3, repeat=10)
    from headspace.attention import attend

    q = torch.randn(32, 16384, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, 8, 16384, 128, device="cuda", dtype=torch.bfloat16)
    seconds = cuda_time(lambda: attend(q, k, v, causal=True), warmup=2, repeat=5)
    attention = 2 * 32 * 128 * 16384**2 / seconds  # causal: half of 4 * N^2 * d per head
    return {"gemm_flops": gemm, "attention_flops": attention}


def prefill_roofline_tok_s(length: int, rates: dict) -> float:
    """Tokens/s of a prefill of ``length`` if GEMMs and attention ran at the measured rates."""
    from headspace.model.config import config_from_dict
    from headspace.planner.plan import Hardware, prefill_compute_seconds

    hw = Hardware(gemm_flops=rates["gemm_flops"], attention_flops=rates["attention_flops"])
    return length / prefill_compute_seconds(config_from_dict(LLAMA3_8B), length, hw)


def planner_limit(mode: str, budget: str) -> dict:
    """Longest context (in steps of 1024 tokens) the planner accepts for ``mode`` under
    ``budget`` on this machine's host memory, and its refusal one step further."""
    from headspace.engine.memory import host_budget, parse_memory
    from headspace.model.config import config_from_dict
    from headspace.planner import PlanRequest, make_plan

    config = config_from_dict(LLAMA3_8B)
    gpu = parse_memory(budget, torch.cuda.get_device_properties(0).total_memory)
    host = host_budget(None)

    def refusal(num_k: int) -> str | None:
        try:
            make_plan(config, PlanRequest(num_k * 1024, gpu, host, 2, mode))
        except UserError as error:
            return str(error)
        return None

    low, high = 1, 1 << 14  # 1K .. 16M tokens
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if refusal(middle) is None else (low, middle)
    return {"tokens": low * 1024, "host_budget_gib": host / GiB, "refusal": refusal(low + 1)}

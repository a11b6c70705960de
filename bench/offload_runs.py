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

from common import LLAMA3_8B, cuda_time, make_engine
from headspace.engine.sampling import SamplingParams
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
    """The engine as a user builds it (the context raised only past the model's own), a
    warm-up that compiles the shapes, then the measured request."""
    needed = length + steps + 8
    options = {"max_context": needed} if needed > model.config.max_context else {}
    engine = make_engine(model, offload=offload, gpu_memory=budget, prefix_caching=False,
                         **options)  # fmt: skip
    vocab = LLAMA3_8B["vocab_size"]
    warm_up(engine, length, length + steps + 1, min(length, 2 * engine.lanes.chunk), vocab)
    _fresh_peak()
    ids = torch.randint(0, vocab, (length,)).tolist()
    params = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)
    out = engine.generate_batch([ids], [params])[0]
    lane = engine.load().lane(out.stats.lane)
    plan = lane.plan
    streamed = plan.head_map.num_offloaded
    return {
        "ok": True, "prefill_tok_s": out.stats.prefill_tok_s,
        "prefill_s": out.stats.prefill_seconds,
        "decode_ms": 1000 * out.stats.decode_seconds / steps,
        "decode_steps": steps, "prefill_chunk": engine.lanes.chunk, **_peaks(), "budget": budget,
        "head_map": plan.head_map.summary(), "summary": out.stats.summary(),
        "streamed_bytes_per_token": streamed * 2 * length * model.config.head_dim * 2,
        "host_pages_gib": lane.host_bytes / GiB,
    }  # fmt: skip


@torch.inference_mode()
def warm_up(engine, length: int, max_tokens: int, chunk_tokens: int, vocab: int) -> None:
    """Compile the shapes of the layout a request of ``length`` prompt tokens (up to
    ``max_tokens``) gets, and pin its host pages: its last ``chunk_tokens`` prefilled over
    an uncomputed history, then two decode steps at its own length (decode kernels compile
    per table width)."""
    from headspace.engine.step_plan import Sequence

    _, lane = engine.lanes.prepare([Sequence(0, [0] * length, max_tokens)])
    runner = lane.runner
    seq = Sequence(10**9, torch.randint(0, vocab, (length,)).tolist(), max_tokens)
    blocks = lane.scheduler.blocks
    blocks.allocate_prompt(seq.seq_id, seq.prompt_ids, lane.scheduler.tiers, reuse=False)
    pages = blocks.pages([seq.seq_id])
    seq.num_cached = length - chunk_tokens
    runner.prefill(seq, engine.lanes.chunk, pages, slot=0)
    for position in (length, length + 1):
        blocks.append_token(seq.seq_id)
        runner.decode([seq.seq_id], [position], [0], pages)
    torch.cuda.synchronize()
    blocks.free(seq.seq_id)


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


def prefill_roofline_tok_s(length: int, rates: dict, attention_share: float = 1.0) -> float:
    """Tokens/s of a prefill of ``length`` if GEMMs and attention (``attention_share`` of
    full causal attention's, as the heads' patterns compute it) ran at the measured rates."""
    from headspace.model.config import config_from_dict
    from headspace.planner.memory import Hardware, prefill_compute_seconds

    hw = Hardware(gemm_flops=rates["gemm_flops"], attention_flops=rates["attention_flops"])
    config = config_from_dict(LLAMA3_8B)
    return length / prefill_compute_seconds(config, length, hw, attention_share)


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

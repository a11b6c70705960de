"""Shared pieces of the GPU benchmarks: environment record, timing, random Llama models."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from pathlib import Path

import torch

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
)


def environment() -> dict:
    """GPU, driver-visible versions and date, recorded in every result file."""
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "num_sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
    }


def cuda_time(fn, *, warmup: int = 1, repeat: int = 3) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs after ``warmup``, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def measure_hbm_bandwidth(num_bytes: int = 4 * 2**30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src), warmup=3, repeat=10)
    return 2 * num_bytes / seconds


def random_hf_llama(config_dict: dict, dtype=torch.bfloat16):
    """A transformers LlamaForCausalLM with random weights, built directly on the GPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**config_dict)
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def write_result(name: str, result: dict) -> Path:
    """Write ``result`` as JSON to bench/results (and $OUT when set); returns the path."""
    text = json.dumps(result, indent=2)
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(text + "\n")
    return path


class _NoText:
    """A tokenizer stand-in for random-weight models: generated text is not looked at."""

    def decode(self, ids, **_):
        return ""


def batch_engine(model, config, max_context: int = 1 << 20):
    """The engine's BatchGenerator for a model built in memory (no checkpoint directory)."""
    from types import SimpleNamespace

    from headspace.engine.batch import BatchGenerator

    engine = SimpleNamespace(
        config=config, model=model, tokenizer=_NoText(), max_context=max_context,
        eos_token_ids=set(), check_length=lambda n: None,
    )  # fmt: skip
    return BatchGenerator(engine)


def prefill_once(generator, ids: list[int]) -> None:
    """One prefill of ``ids`` into fresh pages (no prefix reuse), freed afterwards."""
    from headspace.engine.scheduler import Sequence

    blocks = generator.runner.blocks
    seq = Sequence(10**9, list(ids), len(ids))
    blocks.allocate_prompt(seq.seq_id, seq.prompt_ids, reuse=False)
    try:
        generator.runner.prefill(seq, generator.chunk)
    finally:
        blocks.free(seq.seq_id)

"""Paged-KV benchmark: pool overhead, paged decode bandwidth, mixed-length batch throughput.

    PYTHONPATH=src python bench/paged.py            # on a GPU machine

Llama-3-8B architecture with random bf16 weights. Writes
``bench/results/paged_llama3-8b_<gpu>_<date>.json`` (or into $OUT).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    LLAMA3_8B,
    environment,
    gpu_tag,
    graph_seconds,
    make_engine,
    ran_view,
    random_hf_llama,
    write_result,
)
from headspace.attention.triton_decode import paged_decode_attention  # noqa: E402
from headspace.engine.sampling import SamplingParams  # noqa: E402
from headspace.model.config import config_from_dict  # noqa: E402
from headspace.model.loader import build_model  # noqa: E402

LENGTHS = list(range(500, 8001, 500))  # 16 prompts
NEW_TOKENS = 64
PAGE = 128


def run_batch(model, prompts, warmup_prompts) -> dict:
    """Time the batch after a warm-up of the same lengths (other tokens: no prefix hits),
    so that compiling each shape stays out of the measurement."""
    engine = make_engine(model, page_size=PAGE)
    params = [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)] * len(prompts)
    engine.generate_batch(warmup_prompts, params)
    torch.cuda.synchronize()  # (the batch's peaks are its own: a run starts them over)
    start = time.perf_counter()
    outputs = engine.generate_batch(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    cfg = model.config
    page_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * PAGE * 2
    # every sequence is running at the peak: prompt + generated tokens of each
    peak_tokens = sum(len(p) + NEW_TOKENS - 1 for p in prompts)
    lane = ran_view(engine)
    return {
        "outputs": [o.token_ids for o in outputs],
        "seconds": seconds,
        "kv_overhead_ratio": lane.peak_pages * page_bytes / (peak_tokens * cfg.kv_bytes_per_token),
        "peak_pages": lane.peak_pages,
        "pool_pages": lane.gpu_pages,
        "head_map": lane.layout,
    }


@torch.inference_mode()
def hf_batch(hf, prompts) -> float:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding, as generation needs
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    hf.generate(ids[:, -64:].cuda(), attention_mask=mask[:, -64:].cuda(), max_new_tokens=4)
    torch.cuda.synchronize()
    start = time.perf_counter()
    hf.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS, do_sample=False)  # fmt: skip
    torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_bandwidth(context: int, page: int = PAGE) -> dict:
    """K/V bytes per second of one decode token over 32 layers: paged Triton vs cuDNN."""
    heads, kv_heads, dim, layers = 32, 8, 128, 32
    num_pages = context // page
    pools = [torch.randn(2, kv_heads, num_pages * page, dim, device="cuda", dtype=torch.bfloat16)
             for _ in range(layers)]  # fmt: skip
    table = torch.randperm(num_pages, device="cuda").to(torch.int32)[None]  # scattered pages
    q = torch.randn(1, heads, dim, device="cuda", dtype=torch.bfloat16)
    length = torch.tensor([context], device="cuda")
    num_bytes = layers * pools[0].numel() * 2

    def paged():
        for kv in pools:
            paged_decode_attention(q, kv[0], kv[1], table, length, page)

    def cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            for kv in pools:
                F.scaled_dot_product_attention(q[:, :, None], kv[0][None], kv[1][None],
                                               enable_gqa=True)  # fmt: skip

    paged_bw, cudnn_bw = num_bytes / graph_seconds(paged), num_bytes / graph_seconds(cudnn)
    pools.clear()
    torch.cuda.empty_cache()
    return {"paged_tb_s": paged_bw / 1e12, "cudnn_tb_s": cudnn_bw / 1e12,
            "ratio": paged_bw / cudnn_bw}  # fmt: skip


def main() -> None:
    env = environment()
    bandwidth = {str(n): decode_bandwidth(n) for n in (8192, 32768, 131072)}
    # page size: decode bandwidth at 32K, and the pool overhead of this workload
    page_sweep = {}
    for page in (16, 32, 64, 128, 256):
        held = sum(-(-(n + NEW_TOKENS - 1) // page) * page for n in LENGTHS)
        page_sweep[str(page)] = {
            "decode_tb_s_32k": decode_bandwidth(32768, page)["paged_tb_s"],
            "kv_overhead_ratio": held / sum(n + NEW_TOKENS - 1 for n in LENGTHS),
        }
    hf = random_hf_llama(LLAMA3_8B)
    config = config_from_dict(LLAMA3_8B)
    model = build_model(config, hf.state_dict().__getitem__, "cuda", torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist()
               for n in LENGTHS]  # fmt: skip
    warmup = [[(t + 1) % config.vocab_size for t in p] for p in prompts]
    ours = run_batch(model, prompts, warmup)
    torch.cuda.empty_cache()
    theirs = hf_batch(hf, prompts)
    total_new = NEW_TOKENS * len(prompts)
    longest = max(LENGTHS) + NEW_TOKENS
    contiguous = len(prompts) * longest / sum(n + NEW_TOKENS for n in LENGTHS)
    result = {
        "env": env,
        "config": LLAMA3_8B,
        "workload": {"prompt_lengths": LENGTHS, "new_tokens": NEW_TOKENS, "page_size": PAGE},
        "head_map": ours["head_map"],
        "kv_overhead_ratio": ours["kv_overhead_ratio"],
        # arithmetic, not a measurement: a buffer per request sized to the longest
        "contiguous_overhead_ratio": contiguous,
        "contiguous_overhead_is": "computed (requests x longest / tokens held), not measured",
        "peak_pages": ours["peak_pages"],
        "pool_pages": ours["pool_pages"],
        "decode_bw_ratio_vs_contiguous": {n: b["ratio"] for n, b in bandwidth.items()},
        "decode_bw_tb_s": bandwidth,
        "page_size_sweep": page_sweep,
        "batch_tok_s": total_new / ours["seconds"],
        "batch_seconds": ours["seconds"],
        "transformers_batch_tok_s": total_new / theirs,
        "batch_ratio_vs_transformers": theirs / ours["seconds"],
    }
    gpu = gpu_tag(env)
    path = write_result(f"paged_llama3-8b_{gpu}_{env['date']}.json", result)
    print(f"\nwrote {path}")
    print(f"KV held at peak / minimum: paged {result['kv_overhead_ratio']:.3f}, "
          f"contiguous per request {contiguous:.3f}")  # fmt: skip
    for page, row in page_sweep.items():
        print(f"page {page:>4}: decode at 32K {row['decode_tb_s_32k']:.2f} TB/s, "
              f"pool overhead {row['kv_overhead_ratio']:.3f}")  # fmt: skip
    for n, b in bandwidth.items():
        print(f"decode attention {n:>6}: paged {b['paged_tb_s']:.2f} TB/s, cuDNN "
              f"{b['cudnn_tb_s']:.2f} TB/s, ratio {b['ratio']:.2f}")  # fmt: skip
    print(f"mixed batch: {result['batch_tok_s']:.1f} tok/s vs transformers "
          f"{result['transformers_batch_tok_s']:.1f} tok/s "
          f"({result['batch_ratio_vs_transformers']:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()

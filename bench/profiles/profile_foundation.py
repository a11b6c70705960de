"""Where the time goes: kernel tables for prefill and decode of Llama-3-8B (random bf16).

PYTHONPATH=src python bench/profiles/profile_foundation.py [--length 32768]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent.parent))
from common import LLAMA3_8B, cuda_time, make_engine, prefill_once, random_hf_llama  # noqa: E402
from headspace.engine.step_plan import Sequence  # noqa: E402
from headspace.model.config import config_from_dict  # noqa: E402
from headspace.model.loader import build_model  # noqa: E402


def kernel_table(fn, title: str, rows: int = 14) -> None:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events) / 1000
    print(f"\n== {title}: kernel time {total:.2f} ms")
    print(events.table(sort_by="device_time_total", row_limit=rows, max_name_column_width=70))


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--decode-context", type=int, default=8192)
    parser.add_argument("--decode-only", action="store_true", help="skip the prefill tables")
    args = parser.parse_args()
    hf = random_hf_llama(LLAMA3_8B)
    model = build_model(config_from_dict(LLAMA3_8B), hf.state_dict().__getitem__, "cuda",
                        torch.bfloat16)  # fmt: skip
    pages = 2 * (args.length + 256) // 128
    engine = make_engine(model, num_kv_pages=pages)
    ids = torch.randint(0, 128256, (args.length,)).tolist()
    if not args.decode_only:
        kernel_table(lambda: prefill_once(engine, ids), f"headspace prefill {args.length}")
        batch = torch.tensor([ids], device="cuda")
        kernel_table(lambda: hf(batch, use_cache=True, logits_to_keep=1), "transformers prefill")
    for graph in (False, True):
        engine = make_engine(model, num_kv_pages=pages, cuda_graph=graph)
        profile_decode(engine, ids[: args.decode_context], graph)


def profile_decode(engine, context: list[int], graph: bool) -> None:
    """Time one decode step after ``context`` and list its kernels (a graph's replay too)."""
    seq = Sequence(0, context, len(context) + 64)
    _, lane = engine.lanes.prepare([seq])
    runner, blocks = lane.runner, lane.scheduler.blocks
    blocks.allocate_prompt(seq.seq_id, seq.prompt_ids, lane.scheduler.tiers, reuse=False)
    pages = blocks.pages([seq.seq_id])
    runner.prefill(seq, engine.lanes.chunk, pages, slot=0)
    blocks.append_token(seq.seq_id)

    def step():  # decode the same position again: the timing, not the text, matters here
        runner.decode([seq.seq_id], [len(context)], [0], pages)

    step_ms = 1000 * cuda_time(step, warmup=3, repeat=20)
    print(f"\ndecode step at {len(context)} (graph={graph}): {step_ms:.3f} ms")
    kernel_table(step, f"headspace decode step ({'graph replay' if graph else 'no graph'})")


def gqa_cudnn_probe(length: int = 32768) -> None:
    """Does the cuDNN op take grouped kv heads directly (no expanded copy), and is it faster?"""
    q = torch.randn(1, 32, length, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, length, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def causal(k, v):
        op = torch.ops.aten._scaled_dot_product_cudnn_attention
        return op(q, k, v, None, True, 0.0, True, False, scale=None)[:2]

    def expanded():
        return causal(k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))

    try:
        grouped = causal(k, v)
    except RuntimeError as exc:
        print(f"cudnn GQA: refused ({str(exc)[:80]})")
        return
    diff = (grouped[0].float() - expanded()[0].float()).abs().max().item()
    t_exp, t_grp = cuda_time(expanded), cuda_time(lambda: causal(k, v))
    print(
        f"cudnn GQA: max diff {diff:.2e}, lse shape {tuple(grouped[1].shape)}, "
        f"expanded {t_exp * 1e3:.2f} ms vs grouped {t_grp * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    with torch.inference_mode():
        gqa_cudnn_probe()
    main()

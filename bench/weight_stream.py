"""Decoder layers streamed from pinned host memory (FlexAttn's CPIP), Llama-3.1-8B
architecture with random bf16 weights, on one GPU:

    PYTHONPATH=src python bench/weight_stream.py [--length 32768] [--batch 16]

The same model, in the same run: resident (the default on a GPU that holds it), then under
a 12 GiB GPU budget, where its 15 GiB of weights do not fit and the default (``weights``
auto) streams each layer while the one before computes. Each: one prompt's prefill and
decode, then a batch decoding together (the weights' copy serves every sequence of a step).
Beside them, the floors measured here: a pass's layer bytes over the measured pinned PCIe
rate (decode), and the resident prefill (compute). Writes
``weight_stream_llama3-8b_<gpu>_<date>.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    LLAMA31_8B,
    environment,
    gpu_tag,
    make_engine,
    pinned_h2d_bandwidth,
    random_model,
    write_result,
)
from headspace.engine.sampling import SamplingParams  # noqa: E402
from headspace.engine.weight_stream import streamed_weight_bytes  # noqa: E402
from headspace.model.config import config_from_dict  # noqa: E402
from headspace.planner import PlanRequest, make_plan
from offload_runs import _fresh_peak, _peaks, warm_up  # noqa: E402

GiB = 2**30
BUDGET = "12GiB"
STEPS = 16
VOCAB = LLAMA31_8B["vocab_size"]


def _prompts(count: int, length: int) -> list[list[int]]:
    return [torch.randint(0, VOCAB, (length,)).tolist() for _ in range(count)]


def _plan(engine, lane: str) -> str:
    """The head map summary of the layout ``lane`` ran under."""
    return engine.load().lane(lane).plan.head_map.summary()


def measure(engine, length: int, batch: int, batch_length: int) -> dict:
    """One prompt of ``length`` (prefill, ``STEPS`` decode steps), then ``batch`` prompts of
    ``batch_length`` decoding together (a step: the wall time of the batch with ``STEPS``
    more tokens, less that of its prefill alone); after a warm-up that compiles the shapes."""
    chunk = engine.lanes.chunk
    warm_up(engine, length, length + STEPS + 1, min(length, 2 * chunk), VOCAB)
    _fresh_peak()
    params = SamplingParams(max_new_tokens=STEPS + 1, ignore_eos=True)
    one = engine.generate_batch(_prompts(1, length), [params])[0].stats
    row = {"prefill_tok_s": one.prefill_tok_s, "prefill_s": one.prefill_seconds,
           "decode_ms": 1000 * one.decode_seconds / STEPS, "prefill_chunk": chunk,
           "head_map": _plan(engine, one.lane), **_peaks()}  # fmt: skip
    prompts = _prompts(batch, batch_length)
    walls = []
    for new_tokens in (3, 1, STEPS + 1):  # a warm-up; the decode: the difference of two
        torch.cuda.synchronize()
        start = time.perf_counter()
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        outs = engine.generate_batch(prompts, [params] * batch)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    step_s = (walls[2] - walls[1]) / STEPS
    row.update(batch=batch, batch_length=batch_length, batch_walls_s=walls,
               batch_head_map=_plan(engine, outs[0].stats.lane),
               batch_decode_tok_s=batch / step_s, batch_step_ms=1000 * step_s)  # fmt: skip
    return row


def run(args) -> dict:
    env = environment()
    h2d = pinned_h2d_bandwidth(2 * GiB)
    model = random_model(LLAMA31_8B)
    rows = {}
    engine = make_engine(model, prefix_caching=False)
    rows["resident"] = measure(engine, args.length, args.batch, args.batch_length)
    del engine
    _fresh_peak()
    start = time.perf_counter()
    engine = make_engine(model, prefix_caching=False, gpu_memory=BUDGET)  # auto: streams
    setup_s = time.perf_counter() - start
    pass_bytes = streamed_weight_bytes(model)
    assert pass_bytes > 0, "the 12 GiB budget should make the layers stream"
    rows["streamed"] = {**measure(engine, args.length, args.batch, args.batch_length),
                        "setup_s": setup_s, "pass_bytes": pass_bytes}  # fmt: skip
    return {"env": env, "config": LLAMA31_8B, "h2d_bytes_per_s": h2d, "budget": BUDGET,
            "length": args.length, "steps": STEPS, "rows": rows,
            **_floors(rows, pass_bytes, h2d, args.length)}  # fmt: skip


def _floors(rows: dict, pass_bytes: int, h2d: float, length: int) -> dict:
    """The streamed run against its floors and the planner's prediction."""
    streamed, resident = rows["streamed"], rows["resident"]
    chunks = -(-length // streamed["prefill_chunk"])
    pcie_prefill_s = chunks * pass_bytes / h2d
    prefill_floor_s = max(resident["prefill_s"], pcie_prefill_s)
    step_floor_ms = 1000 * pass_bytes / h2d
    plan = make_plan(config_from_dict(LLAMA31_8B), PlanRequest(length, 12 * GiB, 100 * GiB))
    return {
        "prefill_pcie_floor_s": pcie_prefill_s,
        "prefill_floor_s": prefill_floor_s,
        "prefill_vs_floor": prefill_floor_s / streamed["prefill_s"],
        "prefill_vs_resident": streamed["prefill_tok_s"] / resident["prefill_tok_s"],
        "decode_step_floor_ms": step_floor_ms,
        "decode_vs_floor": step_floor_ms / streamed["decode_ms"],
        "batch_decode_vs_floor": step_floor_ms / streamed["batch_step_ms"],
        "predicted": {"prefill_tok_s": plan.prefill_tok_s, "decode_ms": plan.decode_ms,
                      "head_map": plan.head_map.summary(), "chunk": plan.prefill_chunk},
    }  # fmt: skip


def table(result: dict) -> str:
    rows = result["rows"]
    lines = [f"{'':<10}{'prefill tok/s':>14}{'decode ms':>11}{'batch tok/s':>12}"
             f"{'peak GiB':>10}{'chunk':>7}"]  # fmt: skip
    for name, row in rows.items():
        lines.append(f"{name:<10}{row['prefill_tok_s']:>14,.0f}{row['decode_ms']:>11.1f}"
                     f"{row['batch_decode_tok_s']:>12.1f}{row['peak_reserved_gib']:>10.1f}"
                     f"{row['prefill_chunk']:>7}")  # fmt: skip
    predicted = result["predicted"]
    lines.append(
        f"PCIe {result['h2d_bytes_per_s'] / 1e9:.1f} GB/s; streamed prefill at "
        f"{result['prefill_vs_floor']:.0%} of its floor ({result['prefill_floor_s']:.2f} s), "
        f"decode step at {result['decode_vs_floor']:.0%} of its floor "
        f"({result['decode_step_floor_ms']:.0f} ms), batch step "
        f"{result['batch_decode_vs_floor']:.0%}; planner predicted "
        f"{predicted['prefill_tok_s']:,.0f} tok/s, {predicted['decode_ms']:.0f} ms"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batch-length", type=int, default=1024)
    args = parser.parse_args()
    result = run(args)
    gpu = gpu_tag(result["env"])
    path = write_result(f"weight_stream_llama3-8b_{gpu}_{result['env']['date']}.json", result)
    print(f"wrote {path}")
    print(table(result))


if __name__ == "__main__":
    main()

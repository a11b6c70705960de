"""Foundation benchmark: prefill and decode of Llama-3.1-8B (random bf16) vs transformers.

    PYTHONPATH=src python bench/foundation.py            # on a GPU machine

The engine is built as a user builds it: the model's own 128K context, default options,
once without a budget and once with ``gpu_memory="24GiB"``. Each request goes through the
engine's own loop (planning, paged prefill, CUDA-graph decode, sampling). transformers
runs first, with the same weights, then leaves the GPU, so that each engine's peak
reserved memory (``peak_reserved_gib``, against its budget) is its own. Writes
``bench/results/foundation_llama3-8b_<gpu>_<date>.json`` (or into $OUT).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    LLAMA31_8B,
    cuda_time,
    environment,
    gpu_tag,
    make_engine,
    measure_hbm_bandwidth,
    random_hf_llama,
    write_result,
)
from headspace.engine.sampling import SamplingParams  # noqa: E402
from headspace.model.config import config_from_dict  # noqa: E402
from headspace.model.loader import build_model  # noqa: E402

VOCAB = LLAMA31_8B["vocab_size"]
BUDGETS = {"no budget": {}, "24 GiB budget": {"gpu_memory": "24GiB"}}


def _ids(length: int, rng: torch.Generator) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=rng).tolist()


def ours_prefill(engine, length: int, rng, repeat: int = 3) -> float:
    """Median seconds of a request of ``length`` fresh random tokens and one new token."""
    params = [SamplingParams(max_new_tokens=1, ignore_eos=True)]
    engine.generate_batch([_ids(length, rng)], params)  # warm-up: compiles this length
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate_batch([_ids(length, rng)], params)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ours_decode(engine, length: int, steps: int, rng) -> dict:
    """Decode tok/s after a prompt of ``length``: the engine's own loop."""
    params = [SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)]
    engine.generate_batch([_ids(length, rng)], params)  # warm-up: graph capture
    out = engine.generate_batch([_ids(length, rng)], params)[0]
    return {"tok_s": out.stats.decode_tok_s, "summary": out.stats.summary()}


@torch.inference_mode()
def hf_prefill(model, length: int, rng) -> float:
    batch = torch.tensor([_ids(length, rng)], device="cuda")
    return cuda_time(lambda: model(batch, use_cache=True, logits_to_keep=1))


@torch.inference_mode()
def hf_decode(model, length: int, steps: int, rng) -> float:
    batch = torch.tensor([_ids(length, rng)], device="cuda")

    def run(n):
        return lambda: model.generate(batch, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    t_one = cuda_time(run(1), warmup=1, repeat=2)
    t_many = cuda_time(run(steps + 1), warmup=0, repeat=2)
    return steps / (t_many - t_one)


def measure_transformers(hf, args) -> dict:
    """transformers' prefill tok/s per prefill length and decode tok/s per decode length."""
    rng = torch.Generator().manual_seed(1)
    prefill = {length: length / hf_prefill(hf, length, rng) for length in args.prefill_lengths}
    decode = {length: hf_decode(hf, length, args.decode_steps, rng)
              for length in args.decode_lengths}  # fmt: skip
    return {"prefill": prefill, "decode": decode}


def decode_roofline_tok_s(model, length: int, hbm: float) -> float:
    """Decode tok/s at ``length`` were each step to read the weights (but the embedding
    table, of which it reads a row) and the KV once at ``hbm`` bytes/s."""
    weight_bytes = sum(p.nbytes for p in model.parameters()) - model.embed_tokens.weight.nbytes
    return hbm / (weight_bytes + length * model.config.kv_bytes_per_token)


def measure(engine, theirs: dict, args, hbm: float) -> dict:
    """The engine's rows beside transformers' (``theirs``, :func:`measure_transformers`)."""
    rng = torch.Generator().manual_seed(0)
    rows = {"prefill": {}, "decode": {}}
    for length in tqdm(args.prefill_lengths, desc="prefill", file=sys.stderr):
        ours, their = length / ours_prefill(engine, length, rng), theirs["prefill"][length]
        rows["prefill"][str(length)] = {"tok_s": ours, "transformers_tok_s": their,
                                        "ratio_vs_transformers": ours / their}  # fmt: skip
    for length in tqdm(args.decode_lengths, desc="decode", file=sys.stderr):
        ours, their = ours_decode(engine, length, args.decode_steps, rng), theirs["decode"][length]
        roofline = decode_roofline_tok_s(engine.model, length, hbm)
        rows["decode"][str(length)] = {
            "tok_s": ours["tok_s"], "transformers_tok_s": their,
            "ratio_vs_transformers": ours["tok_s"] / their, "hbm_roofline_tok_s": roofline,
            "fraction_of_hbm_roofline": ours["tok_s"] / roofline, "summary": ours["summary"],
        }  # fmt: skip
    # the process holds only this engine (transformers' model was moved to the CPU)
    rows["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return rows


def headline_keys(configs: dict) -> dict:
    """The figures the targets name, per engine config: prefill against transformers per
    length, decode's fraction of the HBM roofline at the first decode length, peak GiB
    reserved."""
    return {
        "prefill_ratio_vs_transformers": {
            name: {length: row["ratio_vs_transformers"] for length, row in rows["prefill"].items()}
            for name, rows in configs.items()},
        "decode_fraction_of_hbm_roofline": {
            name: next(iter(rows["decode"].values()))["fraction_of_hbm_roofline"]
            for name, rows in configs.items() if rows["decode"]},
        "peak_reserved_gib": {name: rows["peak_reserved_gib"] for name, rows in configs.items()},
    }  # fmt: skip


def print_table(result: dict) -> None:
    print(f"HBM copy bandwidth: {result['hbm_bytes_per_s'] / 1e12:.2f} TB/s")
    print(f"{'engine':<15}{'metric':<9}{'context':>8}{'headspace':>11}{'transformers':>14}"
          f"{'ratio':>7}  roofline")  # fmt: skip
    for name, rows in result["configs"].items():
        for length, row in rows["prefill"].items():
            theirs, ratio = row["transformers_tok_s"], row["ratio_vs_transformers"]
            print(f"{name:<15}{'prefill':<9}{length:>8}{row['tok_s']:>11.0f}{theirs:>14.0f}"
                  f"{ratio:>7.2f}")  # fmt: skip
        for length, row in rows["decode"].items():
            theirs, ratio = row["transformers_tok_s"], row["ratio_vs_transformers"]
            roof = f"{row['fraction_of_hbm_roofline']:.2f} of {row['hbm_roofline_tok_s']:.0f}"
            print(f"{name:<15}{'decode':<9}{length:>8}{row['tok_s']:>11.1f}{theirs:>14.1f}"
                  f"{ratio:>7.2f}  {roof}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill-lengths", default="8192,32768")
    parser.add_argument("--decode-lengths", default="8192")
    parser.add_argument("--decode-steps", type=int, default=128)
    parser.add_argument("--configs", default=",".join(BUDGETS), help="which engine budgets")
    args = parser.parse_args()
    args.prefill_lengths = [int(x) for x in args.prefill_lengths.split(",")]
    args.decode_lengths = [int(x) for x in args.decode_lengths.split(",")]
    env = environment()
    hbm = measure_hbm_bandwidth()
    hf = random_hf_llama(LLAMA31_8B)
    model = build_model(config_from_dict(LLAMA31_8B), hf.state_dict().__getitem__, "cuda",
                        torch.bfloat16)  # fmt: skip
    result = {"env": env, "hbm_bytes_per_s": hbm, "config": LLAMA31_8B, "configs": {}}
    theirs = measure_transformers(hf, args)  # once: its figures do not depend on our budget
    hf.to("cpu")  # so that each engine's peak memory is its own (tensors it shares stay)
    gc.collect()
    for name in args.configs.split(","):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        engine = make_engine(model, **BUDGETS[name])
        rows = measure(engine, theirs, args, hbm)
        lanes, resident = engine.lanes, engine.load().lane("resident")
        rows["engine"] = {
            "options": BUDGETS[name], "max_context": engine.max_context,
            "prefill_chunk": lanes.chunk, "kv_arena_gib": lanes.arena_bytes / 2**30,
            "head_map_summary": resident.plan.head_map.summary(),
            "cuda_graph": lanes.resident.runner.has_graphs,
        }  # fmt: skip
        result["configs"][name] = rows
        del engine, lanes
        gc.collect()
    result.update(headline_keys(result["configs"]))
    gpu = gpu_tag(env)
    path = write_result(f"foundation_llama3-8b_{gpu}_{env['date']}.json", result)
    print(f"\nwrote {path}")
    print_table(result)


if __name__ == "__main__":
    main()

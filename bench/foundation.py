"""Foundation benchmark: prefill and decode of Llama-3-8B (random bf16) vs transformers.

    PYTHONPATH=src python bench/foundation.py            # on a GPU machine

Writes ``bench/results/foundation_llama3-8b_<gpu>_<date>.json`` (or into $OUT).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    LLAMA3_8B,
    batch_engine,
    cuda_time,
    environment,
    measure_hbm_bandwidth,
    prefill_once,
    random_hf_llama,
    write_result,
)
from headspace.engine.config import EngineConfig  # noqa: E402
from headspace.engine.sampling import SamplingParams  # noqa: E402
from headspace.model.config import config_from_dict  # noqa: E402
from headspace.model.loader import build_model  # noqa: E402


def ours_prefill(generator, ids: list[int]) -> float:
    return cuda_time(lambda: prefill_once(generator, ids))


def ours_decode(generator, ids: list[int], steps: int) -> float:
    """Decode tok/s after a prompt of len(ids): the engine's own loop (graph step, sampling)."""
    params = [SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)]
    generator.run([ids], params)  # warm-up: graph capture for this table width
    return generator.run([ids], params)[0].stats.decode_tok_s


@torch.inference_mode()
def hf_prefill(model, ids: torch.Tensor) -> float:
    batch = ids[None].cuda()
    return cuda_time(lambda: model(batch, use_cache=True, logits_to_keep=1))


@torch.inference_mode()
def hf_decode(model, ids: torch.Tensor, steps: int) -> float:
    batch = ids[None].cuda()

    def run(n):
        return lambda: model.generate(batch, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    t_one = cuda_time(run(1), warmup=1, repeat=2)
    t_many = cuda_time(run(steps + 1), warmup=0, repeat=2)
    return steps / (t_many - t_one)


def measure_prefill(engine, hf, lengths, rng) -> dict[int, dict]:
    rows = {}
    for length in tqdm(lengths, desc="prefill", file=sys.stderr):
        ids = torch.randint(0, LLAMA3_8B["vocab_size"], (length,), generator=rng)
        ours = length / ours_prefill(engine, ids.tolist())
        rows[length] = {"ours": ours, "transformers": length / hf_prefill(hf, ids)}
        torch.cuda.empty_cache()
    return rows


def measure_decode(engine, hf, lengths, steps, hbm, rng) -> dict[int, dict]:
    config = engine.runner.model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
    weight_bytes -= hf.model.embed_tokens.weight.numel() * 2  # one embedding row is read
    rows = {}
    for length in tqdm(lengths, desc="decode", file=sys.stderr):
        ids = torch.randint(0, config.vocab_size, (length,), generator=rng)
        ours = ours_decode(engine, ids.tolist(), steps)
        roofline = hbm / (weight_bytes + length * config.kv_bytes_per_token)
        rows[length] = {"ours": ours, "transformers": hf_decode(hf, ids, steps), "roof": roofline}
    return rows


def summarise(result: dict, prefill: dict, decode: dict) -> None:
    """Add the issue's keys (per context length) to ``result``."""

    def per_length(rows, fn):
        return {str(n): fn(r) for n, r in rows.items()}

    result["prefill_tok_s"] = per_length(prefill, lambda r: r["ours"])
    result["prefill_tok_s_transformers"] = per_length(prefill, lambda r: r["transformers"])
    result["prefill_ratio_vs_transformers"] = per_length(
        prefill, lambda r: r["ours"] / r["transformers"]
    )
    result["decode_tok_s"] = per_length(decode, lambda r: r["ours"])
    result["decode_tok_s_transformers"] = per_length(decode, lambda r: r["transformers"])
    result["decode_ratio_vs_transformers"] = per_length(
        decode, lambda r: r["ours"] / r["transformers"]
    )
    result["decode_hbm_roofline_tok_s"] = per_length(decode, lambda r: r["roof"])
    result["decode_fraction_of_hbm_roofline"] = per_length(decode, lambda r: r["ours"] / r["roof"])


def print_table(result: dict) -> None:
    print(f"HBM copy bandwidth: {result['hbm_bytes_per_s'] / 1e12:.2f} TB/s")
    print(
        f"{'metric':<18}{'context':>8}{'headspace':>11}{'transformers':>14}{'ratio':>7}{'roofline':>10}"
    )
    for n, ours in result["prefill_tok_s"].items():
        theirs = result["prefill_tok_s_transformers"][n]
        print(f"{'prefill tok/s':<18}{n:>8}{ours:>11.0f}{theirs:>14.0f}{ours / theirs:>7.2f}")
    for n, ours in result["decode_tok_s"].items():
        theirs = result["decode_tok_s_transformers"][n]
        roof, frac = (
            result["decode_hbm_roofline_tok_s"][n],
            result["decode_fraction_of_hbm_roofline"][n],
        )
        print(
            f"{'decode tok/s':<18}{n:>8}{ours:>11.1f}{theirs:>14.1f}{ours / theirs:>7.2f}"
            f"{roof:>10.0f}  ({frac:.2f} of HBM roofline)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill-lengths", default="8192,32768")
    parser.add_argument("--decode-lengths", default="8192")
    parser.add_argument("--decode-steps", type=int, default=64)
    args = parser.parse_args()
    env = environment()
    hbm = measure_hbm_bandwidth()
    hf = random_hf_llama(LLAMA3_8B)
    config = config_from_dict(LLAMA3_8B)
    model = build_model(config, hf.state_dict().__getitem__, "cuda", torch.bfloat16)
    pages = 2 * (max(map(int, args.prefill_lengths.split(","))) + 256) // 128
    engine_config = EngineConfig(device="cuda", num_kv_pages=pages, prefix_caching=False)
    engine = batch_engine(model, engine_config)
    rng = torch.Generator().manual_seed(0)
    result = {"env": env, "hbm_bytes_per_s": hbm, "config": LLAMA3_8B}
    result["engine"] = {"prefill_chunk": engine.chunk, "cuda_graph": True, "page_size": 128,
                        "kv_pages": pages}  # fmt: skip
    result["head_map"] = (
        f"{config.num_layers * config.num_kv_heads} entries (layer, kv-head): "
        "all tier=gpu (one page pool), pattern=full, budget=None, rank=0"
    )
    lengths = [int(x) for x in args.prefill_lengths.split(",")]
    prefill = measure_prefill(engine, hf, lengths, rng)
    lengths = [int(x) for x in args.decode_lengths.split(",")]
    decode = measure_decode(engine, hf, lengths, args.decode_steps, hbm, rng)
    summarise(result, prefill, decode)
    gpu = env["gpu"].replace("NVIDIA ", "").split()[0].lower()
    path = write_result(f"foundation_llama3-8b_{gpu}_{env['date']}.json", result)
    print(f"\nwrote {path}")
    print_table(result)


if __name__ == "__main__":
    main()

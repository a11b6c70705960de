"""Run under torchrun by tests/test_gpu_ranks.py: every rank on the one GPU (gloo moves the
partial sums), a random Llama-shaped model built alike on each rank; rank 0 saves the fp32
logits (prefill and decode steps) and the greedy tokens."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from headspace.engine.config import EngineConfig
from headspace.engine.engine import Engine
from headspace.engine.hooks import EngineHooks
from headspace.engine.ranks import join
from headspace.engine.sampling import SamplingParams
from headspace.model.config import config_from_dict
from headspace.model.loader import build_model

sys.path.insert(0, str(Path(__file__).parents[1]))  # the tests' graph twin
from graph_twin import EagerGraphTwin  # noqa: E402

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 256,
          "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
          "rms_norm_eps": 1e-5}  # fmt: skip
# three kv heads (of six query heads): two ranks balance them only by copying one
CONFIGS = {"2": CONFIG, "3": {**CONFIG, "num_attention_heads": 6, "num_key_value_heads": 3}}


class NoText:
    def decode(self, ids, **_):
        return ""


def build(device: str, config_dict: dict = CONFIG):
    """The same random model in every process (weights from a fixed seed)."""
    generator = torch.Generator().manual_seed(0)
    config = config_from_dict(config_dict)
    heads, kv = config_dict["num_attention_heads"], config_dict["num_key_value_heads"]
    shapes = {}

    def weight(name: str) -> torch.Tensor:
        if name not in shapes:
            shapes[name] = torch.randn(_shape(name, heads, kv), generator=generator) * 0.05
            if "norm" in name:
                shapes[name] = 1 + shapes[name]
        return shapes[name]

    return build_model(config, weight, device, torch.float32)


def _shape(name: str, heads: int, kv: int) -> tuple[int, ...]:
    hidden, inter, dim = 256, 512, 64
    table = {"embed_tokens": (512, hidden), "lm_head": (512, hidden), "norm": (hidden,),
             "q_proj": (heads * dim, hidden), "k_proj": (kv * dim, hidden),
             "v_proj": (kv * dim, hidden), "o_proj": (hidden, heads * dim),
             "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
             "down_proj": (hidden, inter)}  # fmt: skip
    return next(shape for key, shape in table.items() if key in name)


def run(engine: Engine, prompt: list[int], batch: list[list[int]], num_new: int) -> dict:
    """Logits of ``prompt`` and 16 decode steps, then greedy tokens of ``batch``'s prompts
    generated together."""
    logits = engine.logits(prompt, decode_tokens=16)
    params = SamplingParams(max_new_tokens=num_new, ignore_eos=True)
    outputs = engine.generate_batch(batch, [params] * len(batch))
    graphs = engine.load().lanes[0].decode_graphs  # decode steps replayed as CUDA graphs
    offloaded = outputs[0].stats.num_streamed_heads + outputs[0].stats.num_hybrid_heads
    summary = engine.ranks.head_map.summary() if engine.ranks is not None else ""
    return {"logits": logits, "tokens": [o.token_ids for o in outputs], "graphs": graphs,
            "offloaded": offloaded, "swaps": [o.stats.num_swaps for o in outputs],
            "summary": summary}  # fmt: skip


def main(out_path: str, balance: str, kv_budget: str = "", backend: str = "gloo",
         offload: str = "", kv_heads: str = "2") -> None:  # fmt: skip
    """``backend``: gloo, every rank on GPU 0 (NCCL refuses two ranks on one GPU); nccl, a
    GPU each (decode steps as CUDA graphs, their collectives captured); gloo-twin, gloo with
    decode steps through the graphs' eager twin (the graphs' compiled static blocks, run
    uncaptured since gloo's collectives cannot be). ``offload``, under torchrun (one process
    keeps everything resident: the reference): that mode, in a KV arena of four full pages
    (the prompt's twelve do not fit a rank's half-width pages); ``swap``: the default host
    tier in six full pages, where the prompt fits but four shorter ones (disjoint slices of
    it: no shared prefix) outgrow them as they generate 64 tokens, so sequences swap out to
    host pages and back. ``kv_heads``: 2, or 3 (six query heads), which two ranks balance
    by copying one."""
    device, hooks = "cuda:0", EngineHooks()
    if backend == "gloo-twin":
        hooks, backend = EngineHooks(graphs=EagerGraphTwin), "gloo"
    if "RANK" in os.environ and backend == "gloo":
        dist.init_process_group("gloo")
    elif "RANK" in os.environ:
        device = f"cuda:{os.environ['LOCAL_RANK']}"
    budget = {"kv_budget": float(kv_budget), "kv_policy": "ada_snapkv"} if kv_budget else {}
    prompt = torch.randint(0, 512, (700,), generator=torch.Generator().manual_seed(1)).tolist()
    batch, num_new = [prompt, prompt[:300]], 24
    resident = "RANK" not in os.environ
    if offload == "swap":
        budget.update({} if resident else {"num_kv_pages": 6})
        batch, num_new = [prompt[:150], prompt[150:270], prompt[270:440], prompt[440:540]], 64
    elif offload and not resident:
        budget.update(offload=offload, num_kv_pages=4)
    # copy_seconds 0: this tiny model's heads cost less than a copy adds; priced free, its
    # copies are made and run
    config = EngineConfig.of(device=device, dtype="float32", page_size=64, prefill_chunk=256,
                             gpu_memory="2GiB",  # ranks may share the GPU
                             balance=balance, copy_seconds=0.0, **budget)  # fmt: skip
    config = join(config)  # under torchrun: the process group (NCCL), this rank's GPU
    model = build(config.runtime.device, CONFIGS[kv_heads])
    engine = Engine.from_model(model, NoText(), config, hooks)
    result = run(engine, prompt, batch, num_new)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(result, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])

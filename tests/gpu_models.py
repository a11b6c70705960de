"""Tiny Llama models on the GPU and the engine over them, shared by the GPU tests."""

from __future__ import annotations

import torch

from headspace.engine.config import EngineConfig
from headspace.engine.engine import Engine
from headspace.engine.sampling import SamplingParams
from headspace.model.config import config_from_dict
from headspace.model.loader import build_model
from headspace.planner.memory import decode_bytes, working_bytes


def tiny_model(device: str, dtype: torch.dtype, layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    state = LlamaForCausalLM(hf_config).state_dict()
    state = {k: (v + 0.02 * torch.randn_like(v)) for k, v in state.items()}
    return build_model(config_from_dict(hf_config.to_dict()), state.__getitem__, device, dtype)


class NoText:
    def decode(self, ids, **_):
        return ""


def make_engine(model, hooks=None, **options) -> Engine:
    """The engine over ``model`` on its device (``hooks``: an EngineHooks, if any)."""
    device = str(model.lm_head.weight.device)
    options = {"page_size": 64, "prefill_chunk": 256, **options}
    return Engine.from_model(model, NoText(), EngineConfig.of(device=device, **options), hooks)


def arena_budget(model, arena: int, chunk: int = 256) -> int:
    """A GPU budget whose KV arena is ``arena`` bytes."""
    cfg, itemsize = model.config, model.lm_head.weight.element_size()
    weights = sum(p.nbytes for p in model.parameters())
    return weights + working_bytes(cfg, chunk, itemsize) + decode_bytes(cfg, 64, itemsize) + arena


GREEDY = SamplingParams(max_new_tokens=64, ignore_eos=True)


def greedy(engine: Engine, prompts) -> list[list[int]]:
    return [o.token_ids for o in engine.generate_batch([p.tolist() for p in prompts],
                                                        [GREEDY] * len(prompts))]  # fmt: skip


def stepped(engine: Engine, prompts) -> tuple[list[list[int]], list]:
    """Each prompt's greedy tokens, all added at once and stepped to the end, and the plans
    the lanes took on the way, the offload lane's first (a long request streams there
    while short ones run all resident)."""
    ids = [engine.add_request(p.tolist(), GREEDY) for p in prompts]
    tokens, plans = {}, []
    while engine.has_unfinished():
        tokens |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
        for lane in sorted(engine.load().lanes, key=lambda lane: lane.name != "offload"):
            if lane.plan is not None and all(lane.plan is not seen for seen in plans):
                plans.append(lane.plan)
    plans.sort(key=lambda plan: plan.head_map.num_offloaded == 0)  # (stable: offloaded first)
    return [tokens[i] for i in ids], plans

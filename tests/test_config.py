"""Config parsing, rope frequencies and refusals."""

from __future__ import annotations

import pytest
import torch

from headspace import UserError
from headspace.model.config import config_from_dict
from headspace.model.rope import inverse_frequencies

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_inverse_frequencies_match_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(**{**BASE, "head_dim": 128, "rope_parameters": rope})
    ours = inverse_frequencies(config_from_dict(hf.to_dict()).rope, 128)
    if rope["rope_type"] == "default":
        theirs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 128, 2).float() / 128))
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    assert torch.allclose(ours, theirs.float(), rtol=1e-6, atol=0)


def test_legacy_rope_scaling_is_read():
    config = config_from_dict(
        {**BASE, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert config.rope["rope_type"] == "linear" and config.rope["rope_theta"] == 5e5


def test_family_biases():
    qwen = config_from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen.qkv_bias and not qwen.o_bias
    llama = config_from_dict({**BASE, "attention_bias": True})
    assert llama.qkv_bias and llama.o_bias


def test_mistral_window_bounds_the_context():
    config = config_from_dict(
        {
            **BASE,
            "architectures": ["MistralForCausalLM"],
            "sliding_window": 4096,
            "max_position_embeddings": 32768,
        }
    )
    assert config.max_context == 4096


@pytest.mark.parametrize(
    "change,message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture GPT2LMHeadModel"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type"),
        ({"hidden_size": None}, "malformed"),
    ],
)
def test_refusals(change, message):
    hf = {**BASE, **change}
    if change.get("hidden_size", 1) is None:
        del hf["hidden_size"]
    with pytest.raises(UserError, match=message):
        config_from_dict(hf)

"""The embedded SmolLM2-135M-Instruct: loads offline, answers sensibly, equals transformers."""

from __future__ import annotations

import pytest
import torch

from headspace import LLM, SamplingParams
from headspace.model.source import embedded_gguf_path


@pytest.fixture(scope="module")
def llm(embedded_dir, monkeypatch_module):
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    return LLM()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.mark.parametrize("country,capital", [("France", "Paris"), ("Japan", "Tokyo")])
def test_answers_a_capital_city(llm, country, capital):
    out = llm.generate(
        f"What is the capital of {country}?", SamplingParams(max_new_tokens=24), chat=True
    )[0]
    assert capital in out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] in llm.engine.eos_token_ids


def test_prompt_is_tokenized_exactly_like_the_tokenizer(llm):
    text = "The quick brown fox jumps over the lazy dog."
    assert llm.engine.encode(text) == llm.tokenizer(text)["input_ids"]


def test_stream_pieces_join_to_the_generated_text(llm):
    params = SamplingParams(max_new_tokens=40, temperature=0.8, seed=11)
    pieces = list(llm.stream("Write one sentence about the sea.", params, chat=True))
    streamed = llm.last_output
    again = llm.generate("Write one sentence about the sea.", params, chat=True)[0]
    assert "".join(pieces) == streamed.text == again.text
    assert streamed.token_ids == again.token_ids
    assert len(pieces) > 3


def test_stop_string_ends_generation(llm):
    prompt = "List the days of the week, separated by commas."
    full = llm.generate(prompt, SamplingParams(max_new_tokens=40), chat=True)[0]
    assert "Wednesday" in full.text
    out = llm.generate(prompt, SamplingParams(max_new_tokens=40, stop=["Wednesday"]), chat=True)[0]
    assert out.text == full.text[: full.text.index("Wednesday")]
    assert out.finish_reason == "stop" and len(out.token_ids) < len(full.token_ids)


def test_logits_match_transformers_on_the_real_model(llm, embedded_dir):
    from transformers import AutoModelForCausalLM

    ids = llm.tokenizer("Long-context inference moves the KV cache between tiers. " * 12)[
        "input_ids"
    ]
    hf = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    ours = llm.logits(ids)
    assert (ours - theirs).abs().max().item() <= 1e-4
    chunked = LLM(prefill_chunk=17).logits(ids)
    assert (chunked - ours).abs().max().item() <= 1e-4


def test_gguf_file_path_converts_once_into_the_cache(tmp_path, monkeypatch, llm):
    monkeypatch.setenv("HEADSPACE_CACHE", str(tmp_path))
    from_gguf = LLM(str(embedded_gguf_path()))
    assert from_gguf.model_dir.parent == tmp_path / "models"
    ids = list(range(100, 160))
    assert torch.equal(from_gguf.logits(ids), llm.logits(ids))


def test_a_float32_run_keeps_the_float32_dequantized_weights(llm):
    """The GGUF is dequantized at the run's precision: a float32 run equals transformers'
    own float32 dequantization of the same file (not a bf16-rounded copy of it)."""
    from transformers import AutoModelForCausalLM

    gguf = embedded_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                              dtype=torch.float32).eval()  # fmt: skip
    ids = list(range(200, 264))
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    assert (llm.logits(ids) - theirs).abs().max().item() <= 1e-4
    assert llm.model_dir.name.endswith("-float32")
    bf16 = LLM(dtype="bfloat16")
    assert bf16.model_dir.name.endswith("-bfloat16") and bf16.model_dir != llm.model_dir

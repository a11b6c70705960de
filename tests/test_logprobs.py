"""Log probabilities of generated tokens: the engine's against transformers' logits, in a
batch as alone, streamed step by step as whole."""

from __future__ import annotations

import pytest
import torch

from headspace import SamplingParams, UserError

NEW = 8


def _reference(tiny_hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log probabilities ``[len(tokens), vocab]`` at each generated token."""
    with torch.no_grad():
        logits = tiny_hf_model(torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def test_logprobs_equal_transformers(tiny_cpu_llm, tiny_hf_model, prompt):
    """Each generated token's log probability and the 3 likeliest (ids in order, values)."""
    out = tiny_cpu_llm.engine.run(
        prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=3)
    )
    reference = _reference(tiny_hf_model, prompt, out.token_ids)
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    for step, lp in enumerate(out.logprobs):
        assert lp.logprob == pytest.approx(reference[step, lp.token_id].item(), abs=2e-4)
        values, ids = reference[step].topk(3)
        assert [i for i, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=2e-4)
    assert out.logprobs[0].top[0][0] == out.token_ids[0]  # greedy: the likeliest


def test_logprobs_in_a_batch_and_sampled_and_streamed(tiny_cpu_llm, tiny_hf_model, prompt):
    """Beside a request that asks for none, sampled at temperature 1 (the model's log
    probabilities, before temperature), and each step's new ones in order."""
    engine = tiny_cpu_llm.engine
    other = [(t * 5 + 1) % 40000 for t in prompt[:60]]
    sampled = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=1.0, seed=3,
                             logprobs=0)  # fmt: skip
    outputs = engine.generate_batch([other, prompt], [SamplingParams(max_new_tokens=NEW), sampled])
    assert outputs[0].logprobs is None
    out = outputs[1]
    reference = _reference(tiny_hf_model, prompt, out.token_ids)
    got = [lp.logprob for lp in out.logprobs]
    assert got == pytest.approx([reference[i, t].item() for i, t in enumerate(out.token_ids)],
                                abs=2e-4)  # fmt: skip
    assert all(lp.top == () for lp in out.logprobs)
    engine.add_request(prompt, sampled)
    steps = []
    while engine.has_unfinished():
        steps += [o.new_logprobs for o in engine.step() if o.new_token_ids]
    alone = [lp for step in steps for lp in step]  # (the same seed: the same tokens)
    assert [lp.token_id for lp in alone] == out.token_ids
    assert [lp.logprob for lp in alone] == pytest.approx(got, abs=2e-4)  # (batch shapes)


@pytest.mark.parametrize("top", [-1, 21, True, 1.5])
def test_bad_logprobs_are_refused(top):
    with pytest.raises(UserError, match="logprobs"):
        SamplingParams(logprobs=top)


def test_prompt_logprobs_equal_transformers_and_skip_the_prefix_cache(
    tiny_llama, tiny_hf_model, prompt
):
    """Each prompt token's log probability (None for the first), across prefill pieces of
    64 tokens, as transformers' logits give them; a prompt seen before is computed again for
    them."""
    from headspace import LLM

    engine = LLM(str(tiny_llama), device="cpu", prefill_chunk=64, page_size=16).engine
    engine.run(prompt, SamplingParams(max_new_tokens=2))  # (its pages now in the prefix cache)
    out = engine.run(prompt, SamplingParams(max_new_tokens=2, prompt_logprobs=2))
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    with torch.no_grad():
        logits = tiny_hf_model(torch.tensor([prompt])).logits[0].float()
    reference = torch.log_softmax(logits[:-1], dim=-1)
    got = [lp.logprob for lp in out.prompt_logprobs[1:]]
    assert got == pytest.approx([reference[i, t].item() for i, t in enumerate(prompt[1:])],
                                abs=2e-4)  # fmt: skip
    assert [lp.token_id for lp in out.prompt_logprobs[1:]] == prompt[1:]
    assert [i for i, _ in out.prompt_logprobs[5].top] == reference[4].topk(2).indices.tolist()


def test_logprobs_equal_log_softmax_of_the_engines_own_logits(tiny_cpu_llm, prompt):
    """Generated and prompt tokens' log probabilities against ``log_softmax`` of
    ``Engine.logits`` over the same tokens (its last rows from decode steps, as generation
    runs them): within 1e-5 in fp32."""
    engine = tiny_cpu_llm.engine
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    out = engine.run(prompt, params)
    tokens = prompt + out.token_ids
    logits = engine.logits(tokens[:-1], decode_tokens=len(out.token_ids) - 1)
    reference = torch.log_softmax(logits, dim=-1)  # [positions, vocab]
    want = [reference[i, tokens[i + 1]].item() for i in range(len(tokens) - 1)]
    got = [lp.logprob for lp in out.prompt_logprobs[1:]] + [lp.logprob for lp in out.logprobs]
    assert got == pytest.approx(want, abs=1e-5)


def test_a_prompt_of_the_whole_context_is_scored_and_takes_one_token(
    tiny_llama, tiny_hf_model, prompt
):
    """A prompt of exactly the context (a harness's whole window): its log probabilities as
    transformers' logits give them, and the one token its last position predicts; more new
    tokens, or one prompt token more, are refused with the numbers."""
    from headspace import LLM

    engine = LLM(str(tiny_llama), device="cpu", max_context=len(prompt)).engine
    out = engine.run(prompt, SamplingParams(max_new_tokens=1, prompt_logprobs=0))
    with torch.no_grad():
        logits = tiny_hf_model(torch.tensor([prompt])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    got = [lp.logprob for lp in out.prompt_logprobs[1:]]
    assert got == pytest.approx([reference[i, t].item() for i, t in enumerate(prompt[1:])],
                                abs=2e-4)  # fmt: skip
    assert out.token_ids == [int(reference[-1].argmax())] and out.finish_reason == "length"
    with pytest.raises(UserError, match="leaves room for one new token, not 2") as refused:
        engine.run(prompt, SamplingParams(max_new_tokens=2))
    assert refused.value.param == "max_new_tokens"  # (a server's 400 names max_tokens)
    with pytest.raises(UserError, match=f"does not fit the context of {len(prompt)} tokens"):
        engine.run(prompt + [5], SamplingParams(max_new_tokens=1))

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

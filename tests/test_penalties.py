"""Penalties and ``min_tokens``: the engine's tokens against transformers' generate (the
repetition penalty, ``min_new_tokens``) and against a greedy loop over transformers' logits
with OpenAI's presence and frequency penalties; a penalised request beside plain ones
leaves theirs unchanged."""

from __future__ import annotations

import pytest
import torch

from headspace import SamplingParams, UserError
from headspace.engine.logits_process import process, record, start_history

NEW = 12


def _generate(tiny_cpu_llm, prompt, **params):
    return tiny_cpu_llm.engine.run(
        prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True, **params)
    )


def test_repetition_penalty_equals_transformers(tiny_cpu_llm, tiny_hf_model, prompt):
    """Greedy with a repetition penalty: the same tokens as transformers' generate."""
    ids = torch.tensor([prompt])
    for penalty in (1.5, 0.7):
        hf = tiny_hf_model.generate(ids, max_new_tokens=NEW, do_sample=False,
                                    min_new_tokens=NEW, repetition_penalty=penalty,
                                    pad_token_id=0)  # fmt: skip
        ours = _generate(tiny_cpu_llm, prompt, repetition_penalty=penalty)
        assert ours.token_ids == hf[0, len(prompt) :].tolist()
    changed = _generate(tiny_cpu_llm, prompt, repetition_penalty=1.5).token_ids
    assert changed != _generate(tiny_cpu_llm, prompt).token_ids  # (it changes something here)


def _penalised_greedy(tiny_hf_model, prompt, presence, frequency):
    """A greedy loop over transformers' logits with OpenAI's penalties (fp32)."""
    tokens, counts = list(prompt), {}
    with torch.no_grad():
        for _ in range(NEW):
            logits = tiny_hf_model(torch.tensor([tokens])).logits[0, -1].float()
            for token, count in counts.items():
                logits[token] -= frequency * count + presence
            token = int(logits.argmax())
            counts[token] = counts.get(token, 0) + 1
            tokens.append(token)
    return tokens[len(prompt) :]


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 1.2), (-0.5, 0.8)])
def test_presence_and_frequency_penalties_equal_a_reference_loop(
    tiny_cpu_llm, tiny_hf_model, prompt, presence, frequency
):
    ours = _generate(tiny_cpu_llm, prompt, presence_penalty=presence, frequency_penalty=frequency)
    assert ours.token_ids == _penalised_greedy(tiny_hf_model, prompt, presence, frequency)
    if presence >= 0:  # (the tiny model repeats a token: the penalty changes its output)
        assert ours.token_ids != _generate(tiny_cpu_llm, prompt).token_ids


def test_min_tokens_holds_back_stop_tokens(tiny_cpu_llm, prompt):
    """A stop token that would end the request early cannot come before ``min_tokens`` are
    out; the request then runs on. (A presence penalty makes the tiny model's greedy tokens
    differ from one another.)"""
    varied = {"presence_penalty": 2.0, "max_new_tokens": NEW}
    plain = tiny_cpu_llm.engine.run(prompt, SamplingParams(ignore_eos=True, **varied)).token_ids
    at = next(i for i, token in enumerate(plain) if i > 0 and token not in plain[:i])
    stop = plain[at]
    early = tiny_cpu_llm.engine.run(prompt, SamplingParams(stop_token_ids=[stop], **varied))
    assert early.token_ids == plain[: at + 1] and early.finish_reason == "stop"
    held = tiny_cpu_llm.engine.run(prompt, SamplingParams(stop_token_ids=[stop], min_tokens=at + 3,
                                                 **varied))  # fmt: skip
    assert len(held.token_ids) >= at + 3 and stop not in held.token_ids[: at + 3]
    assert held.token_ids[:at] == plain[:at]  # (nothing else changes)


def test_a_penalised_request_beside_plain_ones_changes_only_its_own_tokens(tiny_cpu_llm, prompt):
    """In one batch, a penalised request's tokens are its own alone and the others' theirs."""
    engine = tiny_cpu_llm.engine
    other = [(t * 7 + 3) % 40000 for t in prompt[:90]]
    penalised = _generate(tiny_cpu_llm, prompt, frequency_penalty=1.0).token_ids
    alone = {"plain": _generate(tiny_cpu_llm, other).token_ids, "penalised": penalised}
    outputs = engine.generate_batch(
        [other, prompt, other],
        [SamplingParams(max_new_tokens=NEW, ignore_eos=True),
         SamplingParams(max_new_tokens=NEW, ignore_eos=True, frequency_penalty=1.0),
         SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.0)],
    )  # fmt: skip
    assert [o.token_ids for o in outputs] == [alone["plain"], alone["penalised"], alone["plain"]]


def test_the_history_counts_picked_tokens_and_masks_before_min_tokens():
    params = SamplingParams(max_new_tokens=8, repetition_penalty=2.0, frequency_penalty=0.5,
                            min_tokens=2, stop_token_ids=[3])  # fmt: skip
    history = start_history(params, [1, 1, 2], frozenset({4}), 6, torch.device("cpu"))
    logits = torch.tensor([1.0, 2.0, -2.0, 5.0, 6.0, 0.5])
    first = process(logits, params, history, generated=0)
    assert first.tolist() == [1.0, 1.0, -4.0, float("-inf"), float("-inf"), 0.5]
    record(history, torch.tensor(5))
    record(history, torch.tensor(5))
    later = process(logits, params, history, generated=2)  # (stops allowed from here)
    assert later.tolist() == [1.0, 1.0, -4.0, 5.0, 6.0, 0.25 - 1.0]


@pytest.mark.parametrize("kwargs, message", [
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 1e-46}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"min_tokens": 200}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
])  # fmt: skip
def test_bad_penalties_are_refused(kwargs, message):
    with pytest.raises(UserError, match=message):
        SamplingParams(max_new_tokens=100, **kwargs)

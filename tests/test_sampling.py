"""Sampling rules and streamed detokenization with stop strings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headspace import SamplingParams, UserError
from headspace.engine.detokenize import CONTEXT_TOKENS, LOOK_BACK, StopStringStreamer
from headspace.engine.sampling import finite_rows, make_generator, sample


def _logits(seed=0, vocab=50):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = _logits()
    assert sample(logits, SamplingParams(), None).item() == logits.argmax().item()


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits(1)
    greedy_like = [
        SamplingParams(temperature=1.0, top_k=1, seed=3),
        SamplingParams(temperature=1.0, top_p=1e-6, seed=3),
    ]
    for params in greedy_like:
        generator = make_generator(params, torch.device("cpu"))
        picks = {sample(logits, params, generator).item() for _ in range(20)}
        assert picks == {logits.argmax().item()}


def test_top_k_restricts_to_k_best():
    logits = _logits(2)
    params = SamplingParams(temperature=2.0, top_k=3, seed=0)
    generator = make_generator(params, torch.device("cpu"))
    picks = {sample(logits, params, generator).item() for _ in range(200)}
    assert picks <= set(torch.topk(logits, 3).indices.tolist()) and len(picks) > 1


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    params = SamplingParams(temperature=1.0, top_p=0.8, seed=0)
    generator = make_generator(params, torch.device("cpu"))
    picks = {sample(logits, params, generator).item() for _ in range(300)}
    assert picks == {0, 1}


def test_same_seed_same_tokens_other_seed_differs():
    logits = _logits(3, vocab=1000) / 3

    def draw(seed):
        params = SamplingParams(temperature=1.0, seed=seed)
        generator = make_generator(params, torch.device("cpu"))
        return [sample(logits, params, generator).item() for _ in range(30)]

    assert draw(5) == draw(5)
    assert draw(5) != draw(6)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop": [""]}, "stop"),
        ({"top_p": 1e-46}, "rounds to 0 in float32"),  # > 0 as a float64, 0 as the sampler's
        ({"temperature": 1e-46}, "rounds to 0 in float32"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_invalid_values_raise_user_error(kwargs, message):
    with pytest.raises(UserError, match=message):
        SamplingParams(**kwargs)


def test_the_smallest_float32_values_still_pick_the_likeliest_token():
    logits = _logits(4)
    for params in (SamplingParams(temperature=1.0, top_p=1e-45, seed=1),
                   SamplingParams(temperature=1e-45, seed=1)):  # fmt: skip
        generator = make_generator(params, torch.device("cpu"))
        assert sample(logits, params, generator).item() == logits.argmax().item()


def test_non_finite_logits_neither_raise_nor_pass_unseen():
    """A row of NaN or infinities picks a token of the vocabulary (no exception inside a
    step), and ``finite_rows`` marks it for its request to end."""
    rows = torch.stack([_logits(5), torch.full((50,), float("nan")), _logits(6)])
    rows[2, 7] = float("inf")
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=2)
    for row in rows:
        token = sample(row, params, make_generator(params, torch.device("cpu"))).item()
        assert 0 <= token < 50
    assert finite_rows(rows).tolist() == [True, False, False]


class _CharTokenizer:
    """One token per character, for exact streaming tests."""

    def decode(self, ids, **_):
        return "".join(chr(i) for i in ids)


def _stream(text: str, stop: list[str]):
    streamer = StopStringStreamer(_CharTokenizer(), stop)
    ids, pieces = [], []
    for ch in text:
        ids.append(ord(ch))
        pieces.append(streamer.update(ids))
        if streamer.stopped:
            break
    pieces.append(streamer.finish())
    return "".join(pieces), streamer


def test_streamer_cuts_at_stop_string_and_never_shows_it():
    shown, streamer = _stream("Hello world. END and more", ["END"])
    assert shown == "Hello world. " and streamer.text == shown and streamer.stopped


def test_streamer_earliest_of_several_stops():
    shown, _ = _stream("abc###def\n\nxyz", ["\n\n", "###"])
    assert shown == "abc"


def test_streamer_without_stop_shows_everything_in_order():
    shown, streamer = _stream("plain text", [])
    assert shown == "plain text" and not streamer.stopped


def test_streamer_holds_back_a_partial_stop():
    streamer = StopStringStreamer(_CharTokenizer(), ["STOP"])
    assert streamer.update([ord(c) for c in "abcST"]) == "ab"  # "cST" could start "STOP"


@pytest.mark.parametrize("min_tokens, shown", [
    (0, "ab"), (4, "ab"), (5, "abENDcd"), (9, "abENDcd"), (10, "abENDcdENDef"),
])  # fmt: skip
def test_no_stop_string_ends_a_request_within_its_min_tokens(min_tokens, shown):
    """As vLLM: a stop string counts only where it ends past the first ``min_tokens``
    tokens' text (one character a token here); one ending at or before it is shown."""
    streamer = StopStringStreamer(_CharTokenizer(), ["END"], min_tokens)
    ids, pieces = [], []
    for ch in "abENDcdENDef":
        ids.append(ord(ch))
        pieces.append(streamer.update(ids))
        if streamer.stopped:
            break
    pieces.append(streamer.finish())
    assert "".join(pieces) == shown and streamer.stopped == (len(shown) < 12)


@pytest.fixture(scope="module")
def embedded_tokenizer(embedded_dir):
    from headspace.model.tokenizer import load_tokenizer

    return load_tokenizer(embedded_dir)


class _CountingTokenizer:
    """The embedded tokenizer, counting the tokens each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, []

    def decode(self, ids, **kwargs):
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(min_size=1, max_size=80), extra=st.lists(st.integers(0, 49151), max_size=12))
def test_streamed_pieces_are_the_whole_decode_of_a_real_tokenizer(embedded_tokenizer, text, extra):
    """With the embedded (byte-level BPE) tokenizer, the pieces of a stream of any text's
    tokens, and of arbitrary ids after them (partial characters among them), join to the
    decode of all of them at once; each step decodes a few tokens, not the whole stream."""
    ids = embedded_tokenizer(text, add_special_tokens=False)["input_ids"] + extra
    counting = _CountingTokenizer(embedded_tokenizer)
    streamer = StopStringStreamer(counting, [])
    pieces = [streamer.update(ids[: i + 1]) for i in range(len(ids))] + [streamer.finish()]
    whole = embedded_tokenizer.decode(ids, skip_special_tokens=True,
                                      clean_up_tokenization_spaces=False)  # fmt: skip
    assert "".join(pieces) == streamer.text == whole  # (replacement characters at its end too)
    if not extra and "\ufffd" not in whole:  # whole characters: a window holds the context
        # and the newest character (one the tokenizer cannot encode whole, as U+40000 here,
        # leaves stray bytes that keep a window open, as the whole decode shows)
        # (the context and the newest character: a bound that the stream's length never moves)
        assert max(counting.decoded[2 * CONTEXT_TOKENS :], default=0) <= CONTEXT_TOKENS + 8


def test_a_stream_of_replacement_characters_is_whole_and_decoded_a_window_at_a_time(
        embedded_tokenizer):  # fmt: skip
    """Tokens of U+FFFD itself, after words and at the end: every one is in the text (none
    lost as an unfinished character), and the windows stay bounded however long the run
    (each step decoding the whole run again cost seconds at a few thousand tokens)."""
    (replacement,) = embedded_tokenizer("\ufffd", add_special_tokens=False)["input_ids"]
    words = embedded_tokenizer("Replacement: ", add_special_tokens=False)["input_ids"]
    ids = words + [replacement] * 400
    counting = _CountingTokenizer(embedded_tokenizer)
    streamer = StopStringStreamer(counting, [])
    pieces = [streamer.update(ids[: i + 1]) for i in range(len(ids))] + [streamer.finish()]
    assert "".join(pieces) == streamer.text == "Replacement: " + "\ufffd" * 400
    assert max(counting.decoded) <= LOOK_BACK + CONTEXT_TOKENS
    assert "".join(pieces[: len(words) + LOOK_BACK + 1])  # shown as it comes, not at the end


def _byte_fallback_tokenizer():
    """A Llama-2-style tokenizer in memory: every byte a token of its own (SentencePiece's
    byte fallback), one word token, and the decoder Llama 2 and Mistral ship."""
    from tokenizers import Tokenizer, decoders, models

    from headspace.model.tokenizer import JsonTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁ok": 3}
    vocab |= {f"<0x{b:02X}>": 4 + b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    return JsonTokenizer(backend, {}, None)


BYTE_FALLBACK = _byte_fallback_tokenizer()


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.one_of(st.text(min_size=1, max_size=4), st.just(None)), max_size=12))
def test_streamed_pieces_are_the_whole_decode_with_byte_fallback(words):
    """Characters as runs of byte tokens (emoji, CJK) between word tokens: the pieces join to
    the whole decode, and the windows stay short (a window that began inside a character
    decoded its whole run as replacement characters and never ended whole)."""
    ids = []
    for word in words:  # None: the word token
        ids += [3] if word is None else [4 + b for b in word.encode()]
    counting = _CountingTokenizer(BYTE_FALLBACK)
    streamer = StopStringStreamer(counting, [])
    pieces = [streamer.update(ids[: i + 1]) for i in range(len(ids))] + [streamer.finish()]
    whole = BYTE_FALLBACK.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == streamer.text == whole
    # (the context, back to a character's start, and the newest character)
    assert max(counting.decoded, default=0) <= 2 * CONTEXT_TOKENS + 8

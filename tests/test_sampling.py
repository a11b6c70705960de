"""Sampling rules and streamed detokenization with stop strings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headspace import SamplingParams, UserError
from headspace.engine.detokenize import CONTEXT_TOKENS, StopStringStreamer
from headspace.engine.sampling import finite_rows, make_generator, sample
from headspace.model.token_bytes import byte_level_alphabet


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
    # a tokenizer whose bytes are not known: replacement characters, guessed unfinished for
    # a while, are the text's at the end and past the wait
    for text in ("ab\ufffd", "ab" + "\ufffd" * 100 + "c"):
        shown, streamer = _stream(text, [])
        assert shown == streamer.text == text


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
    """A tokenizer, counting the tokens each decode call is given (its backend, and so its
    tokens' bytes, as the tokenizer's)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, []
        self.backend_tokenizer = tokenizer.backend_tokenizer

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
    assert max(counting.decoded) <= CONTEXT_TOKENS + 1  # (its bytes known: whole at once)
    assert all(pieces[len(words) : -1])  # each shown as it comes, not at the end


def _byte_level_tokenizer(pieces: list[bytes]):
    """A byte-level BPE tokenizer in memory (Llama 3's and Qwen's decoder): a token for each
    of ``pieces`` (ids 0, 1, ...), then one for each byte not among them."""
    from tokenizers import Tokenizer, decoders, models

    from headspace.model.tokenizer import JsonTokenizer

    char = {byte: c for c, byte in byte_level_alphabet().items()}
    vocab: dict[str, int] = {}
    for piece in [*pieces, *(bytes([b]) for b in range(256))]:
        vocab.setdefault("".join(char[b] for b in piece), len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.ByteLevel()
    return JsonTokenizer(backend, {}, None)


BYTE_LEVEL = _byte_level_tokenizer([b"hello", "\ufffd".encode(), b" x", b"ab", b"cd",
                                    b" \xe2\x80", b"\x94"])  # fmt: skip
BYTE_ID = {byte: BYTE_LEVEL.backend_tokenizer.token_to_id(c)  # each byte's own token
           for c, byte in byte_level_alphabet().items()}  # fmt: skip


def _joined(tokenizer, ids: list[int], stop=(), min_tokens: int = 0):
    """The pieces of a stream of ``ids`` joined, the streamer, and the windows' sizes."""
    counting = _CountingTokenizer(tokenizer)
    streamer = StopStringStreamer(counting, list(stop), min_tokens)
    pieces = []
    for i in range(len(ids)):
        pieces.append(streamer.update(ids[: i + 1]))
        if streamer.stopped:
            break
    pieces.append(streamer.finish())
    return "".join(pieces), streamer, counting.decoded


def test_a_character_split_over_tokens_after_replacement_characters_streams_whole():
    """Tokens of U+FFFD itself, then a character whose bytes come a token each: the stream
    shows what the whole decode shows (a guess from the text alone took the last U+FFFD
    for an unfinished character, or the split one's first bytes for U+FFFD)."""
    for run in (1, 29, 30, 40):
        ids = [0] + [1] * run + [BYTE_ID[b] for b in "中".encode()] + [2]
        shown, streamer, _ = _joined(BYTE_LEVEL, ids)
        assert shown == streamer.text == BYTE_LEVEL.decode(ids) == "hello" + "\ufffd" * run + "中 x"


def test_byte_fallback_runs_of_replacement_characters_stream_whole():
    """With byte fallback, U+FFFD as its three byte tokens, many in a row between word
    tokens: the text and the stream are the whole decode (a window begun inside one of them
    read every byte as a replacement character of its own)."""
    for run in (1, 11, 15, 40):
        ids = [3] + [4 + b for b in "\ufffd".encode() * run] + [3]
        shown, streamer, decoded = _joined(BYTE_FALLBACK, ids)
        assert shown == streamer.text == BYTE_FALLBACK.decode(ids, skip_special_tokens=True)
        assert max(decoded) <= 2 * CONTEXT_TOKENS + 8


def test_no_stop_string_ends_within_min_tokens_when_the_last_of_them_is_half_a_character():
    """The ``min_tokens``-th token ends inside a character (held until the next one): a
    stop string ending within its text still does not count."""
    ids = [3, 4, 5, 6]  # "ab", "cd", " " and the first bytes of "—", the rest of "—"
    shown, streamer, _ = _joined(BYTE_LEVEL, ids, stop=["d "], min_tokens=3)
    assert shown == streamer.text == "abcd —" and not streamer.stopped
    shown, streamer, _ = _joined(BYTE_LEVEL, ids, stop=["d "], min_tokens=2)
    assert shown == "abc" and streamer.stopped  # (past min_tokens it counts)


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

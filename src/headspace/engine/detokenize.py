"""Incremental detokenization with stop strings: text pieces safe to show as they come."""

from __future__ import annotations

from headspace.model.token_bytes import (
    ends_inside_character,
    starts_inside_character,
    token_byte_reader,
)

# tokens decoded again before the new ones, for their context (a SentencePiece token's
# leading space, a byte-level token's partial character): as vLLM's incremental decoding
CONTEXT_TOKENS = 5
# tokens a window's start may go back to begin on a whole character; for a tokenizer whose
# bytes are not known, also those a window ending in replacement characters waits for them
# to become one (past it they are the text's own)
LOOK_BACK = 32
REPLACEMENT = "\ufffd"  # what a decoder shows for bytes that are no whole character (yet)


class StopStringStreamer:
    """Turns a growing list of token ids into text pieces, cutting at the first stop string.

    A piece is released only when it can no longer become part of a stop string or of an
    unfinished multi-byte character. Each update decodes only the newest tokens, with a few
    before them for context (the text of the window past the context is what they add):
    decoding every token so far at every step cost the engine's thread a third of its time
    at 1,500 tokens a stream (bench/NOTES.md). A stop string counts only where it ends past
    the text of the first ``min_tokens`` tokens (vLLM's ``min_tokens``: no stop before them).
    Where the tokenizer's bytes are known (:mod:`headspace.model.token_bytes`), a token
    that ends inside a character is read from them; elsewhere a text ending in replacement
    characters waits up to ``LOOK_BACK`` tokens.
    """

    def __init__(self, tokenizer, stop: list[str], min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = stop
        self.min_tokens = min_tokens
        self._min_chars = 0  # the text's length at ``min_tokens`` tokens (its last update)
        self._min_unread = False  # a token within ``min_tokens`` was held: its text unknown
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self._bytes = token_byte_reader(tokenizer)  # token id -> its bytes (None: unknown)
        self._decoded = ""  # the text of the tokens read so far (not cut)
        self._context = 0  # the first token the next window decodes
        self._before = ""  # the text of the tokens from ``_context`` on, read so far
        # the token ids last given, and how many (a later stop token is none of them)
        self._read: list[int] = []
        self._num_read = 0
        self._held = False  # whether the last ones end inside a character

    def update(self, token_ids: list[int]) -> str:
        """Decode ``token_ids`` (all generated so far, the earlier ones as before); returns
        the new piece to show."""
        self._read, self._num_read = token_ids, len(token_ids)
        text = self._grown(token_ids)
        self._held = text is None
        within = len(token_ids) <= self.min_tokens
        if text is None:  # inside a character: wait for its other bytes
            self._min_unread |= within
            return ""
        if within or self._min_unread:  # (past the held one: a little more, never less)
            self._min_chars, self._min_unread = len(text), False
        search_from = max(0, self.emitted - self.hold_back)
        cuts = [i for i in (text.find(s, max(search_from, self._min_chars - len(s) + 1))
                            for s in self.stop) if i >= 0]  # fmt: skip
        if cuts:
            self.text, self.stopped = text[: min(cuts)], True
            return self._release(len(self.text))
        self.text = text
        return self._release(max(self.emitted, len(text) - self.hold_back))

    def _grown(self, token_ids: list[int], final: bool = False) -> str | None:
        """The text of all of ``token_ids``; None while it ends inside a character (unless
        ``final``: what its bytes show then is the text's)."""
        before, window = self._before, self._decode(token_ids[self._context :])
        if not final and self._inside(token_ids, window):
            return None
        if len(window) > len(before):
            if window.startswith(before):
                self._decoded += window[len(before) :]
            else:  # the context reads otherwise now: from the start
                self._decoded = self._decode(token_ids)
            self._next_context(token_ids)
        return self._decoded

    def _inside(self, token_ids: list[int], window: str) -> bool:
        """Whether ``token_ids`` end inside a character: read from their bytes where they
        are known, else guessed from ``window`` (the text from the context on) ending in
        replacement characters, for at most ``LOOK_BACK`` tokens (a token of U+FFFD itself
        shows the same). A text that ends otherwise ends on a whole character."""
        if not window.endswith(REPLACEMENT):
            return False
        if self._bytes is not None:
            return ends_inside_character(self._bytes, token_ids)
        return len(token_ids) - self._context < LOOK_BACK

    def _next_context(self, token_ids: list[int]) -> None:
        """The next window's context and its text: ``CONTEXT_TOKENS`` before the end, or
        earlier where that one starts inside a character (a byte-fallback decoder turns a
        whole run of bytes into replacement characters if it starts mid-character, so that
        no later window would end whole); the very start when none within ``LOOK_BACK``
        does."""
        end = len(token_ids)
        start = max(0, end - CONTEXT_TOKENS)
        text = self._decode(token_ids[start:end])
        while start > 0 and self._starts_inside(token_ids[start], text):
            start = start - 1 if end - start < LOOK_BACK else 0
            text = self._decode(token_ids[start:end])
        self._context, self._before = start, text

    def _starts_inside(self, token_id: int, text: str) -> bool:
        """Whether a window starting at ``token_id`` (its text ``text``) starts inside a
        character: read from the token's first byte where bytes are known, else guessed
        from a replacement character there that the text so far does not end with. A text
        that starts otherwise starts on a whole character."""
        if not text.startswith(REPLACEMENT):
            return False
        if self._bytes is not None:
            return starts_inside_character(self._bytes, token_id)
        return not self._decoded.endswith(text)

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)  # fmt: skip

    def finish(self) -> str:
        """Release what was held back at the end of generation: where the last tokens ended
        inside a character, what their bytes show (replacement characters, the text's as
        the whole decode's), with no stop string searched in it (the request ended for
        another reason)."""
        if self._held and not self.stopped:
            self.text = self._grown(self._read[: self._num_read], final=True)
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        piece = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return piece

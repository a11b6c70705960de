"""Incremental detokenization with stop strings: text pieces safe to show as they come."""

from __future__ import annotations

# tokens decoded again before the new ones, for their context (a SentencePiece token's
# leading space, a byte-level token's partial character): as vLLM's incremental decoding
CONTEXT_TOKENS = 5
# tokens a window's start may go back to begin on a whole character, and that a window ending
# in replacement characters waits for them to become one (past it they are the text's own)
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
    """

    def __init__(self, tokenizer, stop: list[str], min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = stop
        self.min_tokens = min_tokens
        self._min_chars = 0  # the text's length at ``min_tokens`` tokens (its last update)
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self._decoded = ""  # the text of the tokens read so far (not cut)
        self._context = 0  # the first token the next window decodes
        self._before = ""  # the text of the tokens from ``_context`` on, read so far
        # the token ids last given, and how many (a later stop token is none of them)
        self._read: list[int] = []
        self._num_read = 0
        self._held = False  # whether the last ones end in an unfinished character

    def update(self, token_ids: list[int]) -> str:
        """Decode ``token_ids`` (all generated so far, the earlier ones as before); returns
        the new piece to show."""
        self._read, self._num_read = token_ids, len(token_ids)
        text = self._grown(token_ids)
        self._held = text is None
        if text is None:  # an unfinished UTF-8 sequence: wait for more bytes
            return ""
        if len(token_ids) <= self.min_tokens:
            self._min_chars = len(text)
        return self._stop_or_release(text)

    def _stop_or_release(self, text: str) -> str:
        """Cut ``text`` (all so far) at its first stop string and release what no stop
        string can still claim."""
        search_from = max(0, self.emitted - self.hold_back)
        cuts = [i for i in (text.find(s, max(search_from, self._min_chars - len(s) + 1))
                            for s in self.stop) if i >= 0]  # fmt: skip
        if cuts:
            self.text, self.stopped = text[: min(cuts)], True
            return self._release(len(self.text))
        self.text = text
        return self._release(max(self.emitted, len(text) - self.hold_back))

    def _grown(self, token_ids: list[int], final: bool = False) -> str | None:
        """The text of all of ``token_ids``; None while its last character may be unfinished
        (replacement characters at its end, for at most ``LOOK_BACK`` tokens: past them,
        or when ``final``, they are the text's, as a token of U+FFFD itself is)."""
        before, window = self._before, self._decode(token_ids[self._context :])
        waits = len(token_ids) - self._context < LOOK_BACK and not final
        if window.endswith(REPLACEMENT) and waits:
            return None
        if len(window) > len(before):
            if window.startswith(before):
                self._decoded += window[len(before) :]
            else:  # the context reads otherwise now: from the start
                self._decoded = self._decode(token_ids)
            self._next_context(token_ids)
        return self._decoded

    def _next_context(self, token_ids: list[int]) -> None:
        """The next window's context and its text: ``CONTEXT_TOKENS`` before the end, or
        earlier where that one starts inside a character (a byte-fallback decoder turns a
        whole run of bytes into replacement characters if it starts mid-character, so that
        no later window would end whole); the very start when none within ``LOOK_BACK``
        does. A window whose text ends the text so far (a token of U+FFFD itself first)
        starts where it is."""
        end = len(token_ids)
        start = max(0, end - CONTEXT_TOKENS)
        text = self._decode(token_ids[start:end])
        while start > 0 and text.startswith(REPLACEMENT) and not self._decoded.endswith(text):
            start = start - 1 if end - start < LOOK_BACK else 0
            text = self._decode(token_ids[start:end])
        self._context, self._before = start, text

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)  # fmt: skip

    def finish(self) -> str:
        """Release what was held back at the end of generation: where the last tokens ended
        in replacement characters, those too (up to a stop string), which are the text's."""
        if self._held and not self.stopped:
            text = self._grown(self._read[: self._num_read], final=True)
            return self._stop_or_release(text) + self._release(len(self.text))
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        piece = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return piece

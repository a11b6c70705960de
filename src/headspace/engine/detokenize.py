"""Incremental detokenization with stop strings: text pieces safe to show as they come."""

from __future__ import annotations


class StopStringStreamer:
    """Turns a growing list of token ids into text pieces, cutting at the first stop string.

    A piece is released only when it can no longer become part of a stop string or of an
    unfinished multi-byte character.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def update(self, token_ids: list[int]) -> str:
        """Decode ``token_ids`` (all generated so far); returns the new piece to show."""
        text = self.tokenizer.decode(
            token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        if text.endswith("\ufffd"):  # an unfinished UTF-8 sequence: wait for more bytes
            return ""
        search_from = max(0, self.emitted - self.hold_back)
        cuts = [i for i in (text.find(s, search_from) for s in self.stop) if i >= 0]
        if cuts:
            self.text, self.stopped = text[: min(cuts)], True
            return self._release(len(self.text))
        self.text = text
        return self._release(max(self.emitted, len(text) - self.hold_back))

    def finish(self) -> str:
        """Release what was held back at the end of generation."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        piece = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return piece

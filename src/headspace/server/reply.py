"""The OpenAI API's response shapes, as `vllm serve` writes them: a completion or chat
completion whole or in streamed chunks, with usage and log probabilities (the requests:
:mod:`headspace.server.protocol`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from headspace.engine.outputs import RequestOutput, TokenLogprob


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outputs: list[RequestOutput], hidden: bool = False) -> dict:
    """The prompt counted once, the tokens of every choice (none where ``hidden``)."""
    output = outputs[0]
    prompt = output.stats.prompt_tokens
    generated = 0 if hidden else sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": generated,
            "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}}  # fmt: skip


@dataclass
class Reply:
    """One request's response shapes: ``request_id`` and ``created`` (Unix seconds) the
    same in every chunk; ``chat``: chat completion shapes, else text completion ones."""

    request_id: str
    model: str
    chat: bool
    token_text: Callable[[int], str] = str  # a token's text (log probabilities name it)
    # a token's own bytes (a chat's logprobs give them: a character split over tokens is
    # whole again when they are joined); None: its text's
    token_bytes: Callable[[int], bytes] | None = None
    echo: tuple[str, list[int]] | None = None  # a completion's prompt (text, ids), echoed
    hidden: bool = False  # a completion's generated token left out (max_tokens 0)
    created: int = field(default_factory=lambda: int(time.time()))
    _offsets: dict[int, int] = field(default_factory=dict)  # choice -> text offset so far
    _echoed: dict | None = None  # an echoed prompt's logprobs lists (every choice's first)

    def _head(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"  # fmt: skip
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model}  # fmt: skip

    def completion(self, outputs: list[RequestOutput]) -> dict:
        """The whole response of a finished request: a choice per output, in order."""
        choices, prompt = [], outputs[0].prompt_logprobs if outputs else None
        for index, output in enumerate(outputs):
            reason = output.finish_reason  # "stop", "length" or "abort", as OpenAI's
            if self.chat:
                choice = {"message": {"role": "assistant", "content": output.text}}
                logprobs = self._chat_logprobs(output.logprobs)
            else:
                choice, logprobs = self._text_choice(output, index, prompt)
            choices.append({"index": index, **choice, "logprobs": logprobs,
                            "finish_reason": reason})  # fmt: skip
        return {**self._head(False), "choices": choices, "usage": usage(outputs, self.hidden)}

    def _text_choice(self, output: RequestOutput, index: int,
                     prompt_logprobs: list | None) -> tuple[dict, dict | None]:  # fmt: skip
        """A completion's text and log probabilities: the prompt's first when echoed
        (``prompt_logprobs``, the first choice's; its first token's null, as OpenAI's),
        the generated ones unless hidden."""
        text, logprobs = output.text, output.logprobs
        if self.hidden:
            text, logprobs = "", None if logprobs is None else []
        entries = None if logprobs is None else [(lp.token_id, lp) for lp in logprobs]
        if self.echo is None:
            return {"text": text}, self._text_logprobs(entries, index)
        prompt_text, prompt_ids = self.echo
        if entries is None:
            return {"text": prompt_text + text}, None
        if self._echoed is None:  # the prompt's part, the same in every choice: made once
            prompt = prompt_logprobs or [None] * len(prompt_ids)
            self._echoed = self._text_logprobs(list(zip(prompt_ids, prompt, strict=True)), -1)
        self._offsets[index] = self._offsets[-1]  # (the generated tokens' offsets follow)
        generated = self._text_logprobs(entries, index)
        return {"text": prompt_text + text}, {key: self._echoed[key] + generated[key]
                                              for key in self._echoed}  # fmt: skip

    def chunk(self, text: str | None, reason: str | None, role: bool = False, index: int = 0,
              logprobs: list[TokenLogprob] | None = None) -> dict:  # fmt: skip
        """One streamed piece of choice ``index``: new ``text`` (a chat delta, with the
        assistant's ``role`` on the first), its tokens' ``logprobs`` where asked for, and
        the finish reason on the last."""
        if self.chat:
            delta = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": self._chat_logprobs(logprobs),
                      "finish_reason": reason}  # fmt: skip
        else:
            entries = None if logprobs is None else [(lp.token_id, lp) for lp in logprobs]
            choice = {"index": index, "text": text or "",
                      "logprobs": self._text_logprobs(entries, index),
                      "finish_reason": reason}  # fmt: skip
        return {**self._head(True), "choices": [choice]}

    def _chat_logprobs(self, logprobs: list[TokenLogprob] | None) -> dict | None:
        """A chat's ``logprobs``: a ``content`` list (None where not asked for)."""
        if logprobs is None:
            return None

        def entry(token: int, logprob: float) -> dict:
            shown = self.token_text(token)
            raw = shown.encode() if self.token_bytes is None else self.token_bytes(token)
            return {"token": shown, "logprob": logprob, "bytes": list(raw)}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs]}  # fmt: skip

    def _text_logprobs(self, entries: list[tuple[int, TokenLogprob | None]] | None,
                       index: int) -> dict | None:  # fmt: skip
        """A completion's ``logprobs`` of ``entries`` (token id, its log probability or None
        for an echoed prompt's first): OpenAI's parallel lists, ``text_offset`` counted from
        the choice's first token across chunks (None where not asked for)."""
        if entries is None:
            return None
        text = self.token_text
        tokens = [text(token) for token, _ in entries]
        offsets, at = [], self._offsets.get(index, 0)
        for token in tokens:
            offsets.append(at)
            at += len(token)
        self._offsets[index] = at
        return {"tokens": tokens,
                "token_logprobs": [lp and lp.logprob for _, lp in entries],
                "top_logprobs": [lp and {text(t): v for t, v in lp.top} for _, lp in entries],
                "text_offset": offsets}  # fmt: skip

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        """The last streamed piece with ``stream_options.include_usage``: usage, no choices."""
        return {**self._head(True), "choices": [], "usage": usage(outputs)}

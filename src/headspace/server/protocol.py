"""The OpenAI API's request and response shapes, as `vllm serve` speaks them.

Requests are pydantic models: a field of the wrong type or out of range is a 400 in OpenAI's
error shape (``{"error": {"message", "type", "param", "code"}}``); fields this server does
not know are ignored, as OpenAI-compatible servers do; ones it knows and cannot honour
(``n`` > 1, penalties, log-probabilities) are refused by name.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from headspace.engine.outputs import RequestOutput
from headspace.engine.sampling import SamplingParams

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


class APIError(Exception):
    """An error a client gets in OpenAI's shape: HTTP ``status``, ``message``, ``kind`` (the
    error's type), ``param`` (the request field at fault)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}  # fmt: skip


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # 0 or -1: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @model_validator(mode="after")
    def _supported(self):
        if self.n != 1:
            raise ValueError(f"n must be 1 (one choice per request), got {self.n}")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported")
        if isinstance(self.stop, list) and any(not s for s in self.stop) or self.stop == "":
            raise ValueError("stop strings must be non-empty")
        return self

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_new_tokens=self.max_tokens or default_max_tokens,
                              temperature=self.temperature, top_p=self.top_p,
                              top_k=max(self.top_k, 0), seed=self.seed, stop=stop,
                              ignore_eos=self.ignore_eos)  # fmt: skip

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of one of them."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = False
    logprobs: int | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            if len(self.prompt) != 1:
                raise ValueError("one prompt per request (a list of several is not supported)")
            self.prompt = self.prompt[0]
        if not self.prompt:
            raise ValueError("the prompt is empty")
        if self.echo or self.logprobs is not None:
            raise ValueError("echo and logprobs are not supported")
        return self


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role,
                "content": content or ""}  # fmt: skip


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` through the tokenizer's chat template."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False

    @model_validator(mode="after")
    def _chat(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.logprobs:
            raise ValueError("logprobs are not supported")
        return self


# -- responses ---------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(output: RequestOutput) -> dict:
    prompt, generated = output.stats.prompt_tokens, len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": generated,
            "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}}  # fmt: skip


def finish_reason(output: RequestOutput) -> str | None:
    return FINISH_REASONS.get(output.finish_reason) if output.finish_reason else None


def completion(request_id: str, model: str, output: RequestOutput, chat: bool) -> dict:
    """The whole response of a finished request."""
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": output.text},
                  "logprobs": None, "finish_reason": finish_reason(output)}  # fmt: skip
    else:
        choice = {"index": 0, "text": output.text, "logprobs": None,
                  "finish_reason": finish_reason(output)}  # fmt: skip
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(output)}  # fmt: skip


def chunk(request_id: str, model: str, text: str | None, reason: str | None, chat: bool,
          role: bool = False) -> dict:  # fmt: skip
    """One streamed piece: new ``text`` (a chat delta, with the assistant's ``role`` on the
    first), and the finish reason on the last."""
    if chat:
        delta = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}  # fmt: skip


def usage_chunk(request_id: str, model: str, output: RequestOutput, chat: bool) -> dict:
    """The last streamed piece with ``stream_options.include_usage``: no choices, usage."""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(output)}  # fmt: skip

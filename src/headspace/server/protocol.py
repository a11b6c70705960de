"""The OpenAI API's request shapes, as `vllm serve` speaks them, and its errors (the
responses: :mod:`headspace.server.reply`).

Requests are pydantic models: a field of the wrong type or out of range is a 400 in OpenAI's
error shape (``{"error": {"message", "type", "param", "code"}}``); fields this server does
not know are ignored, as OpenAI-compatible servers do; ones it knows and cannot honour
(``best_of`` > 1, ``echo`` with ``stream``, vLLM's ``prompt_logprobs``, tools) are refused by
name unless their value asks for nothing. Types are strict, as OpenAI's: a number is a JSON
number (an integer where one is meant; ``3.0``, ``"3"`` and ``true`` are refused), a boolean
JSON's true or false.
Penalties and ``min_tokens`` are vLLM's; log probabilities, ``echo`` and ``max_tokens`` 0
are OpenAI's.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from headspace.engine.sampling import MOST_LOGPROBS, REPETITION_PENALTY, SamplingParams

GREEDY_BELOW = 1e-5  # a temperature this small is greedy (sampling would overflow)
UNPAIRED = re.compile("[\ud800-\udfff]")  # halves of UTF-16 pairs (JSON lets them in): not text
MOST_STOPS, MOST_STOP_CHARS = 64, 1000  # stop strings a request may give (OpenAI allows 4)
MOST_CHOICES = 16  # ``n``: choices a request may ask for (each runs as a request)
# messages (and content parts) a conversation may hold: each is validated as an object on the
# event loop's thread (2-5 us, which every client waits for), so a longer list is refused by
# its length first
MOST_MESSAGES = 16384
STOPS_BOUND = f"stop takes at most {MOST_STOPS} strings of at most {MOST_STOP_CHARS} characters"
# the engine's sampling fields that a request names otherwise
API_FIELDS = {"max_new_tokens": "max_tokens", "prompt_logprobs": "logprobs"}
# fields of OpenAI's API this server cannot honour: refused by name, not ignored
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "response_format",
               "logit_bias", "suffix", "prediction", "audio", "modalities",
               "use_beam_search", "prompt_logprobs")  # fmt: skip
ASKS_NOTHING = {"use_beam_search": (False,)}
TopLogprobs = Annotated[int, Field(ge=0, le=MOST_LOGPROBS)]
STRICT = ConfigDict(extra="ignore", strict=True)  # (unknown fields ignored, as OpenAI does)


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


def engine_stopped() -> APIError:
    """What every request gets once the engine loop has stopped (the process exits)."""
    return APIError(503, "the engine has stopped; the server exits", "server_error")


def shutting_down(ended: bool) -> APIError:
    """What a request gets while the server shuts down: a new one, or one it ``ended``."""
    message = ("the server is shutting down; this request was ended before it finished" if ended
               else "the server is shutting down and takes no new requests")  # fmt: skip
    return APIError(503, message, "server_error")


def ended_alone(ended: str | None) -> APIError:
    """What a request the engine ended alone (finish reason "error") gets, by why it ended
    (``GenerationStats.ended``): its logits not finite (500), or no KV page for it, on
    the GPU or in host memory (503: the server is full; sent again later, it may run)."""
    if ended == "no pages":
        message = ("the server ran out of KV cache memory for this request (no free page, "
                   "and none in host memory to move it to); it was ended, the other "
                   "requests go on")  # fmt: skip
        return APIError(503, message, "server_error")
    message = ("the model's logits for this request were not finite (NaN or infinity); it "
               "was ended, the other requests go on")  # fmt: skip
    return APIError(500, message, "server_error")


def _asks_nothing(name: str, value) -> bool:
    """Whether an unsupported field's value leaves the request as it is."""
    if name in ("tools", "functions"):
        return value == []
    if name in ("tool_choice", "function_call"):
        return value == "none"
    if name == "response_format":
        return isinstance(value, dict) and value.get("type") == "text"
    if name in ASKS_NOTHING:  # (False == 0 in Python: booleans only where a boolean is meant)
        return any(value == v and type(value) is type(v) for v in ASKS_NOTHING[name])
    return value in ("", {})


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields completions and chat completions share."""

    model_config = STRICT

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0  # 0 or -1: off
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MOST_STOPS)] = []
    stream: bool = False  # (JSON's true or false: "yes" is refused, not taken as true)
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MOST_CHOICES)] = 1
    ignore_eos: bool = False
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    repetition_penalty: Annotated[float, Field(ge=REPETITION_PENALTY[0], le=REPETITION_PENALTY[1],
                                               allow_inf_nan=False)] = 1.0  # fmt: skip
    min_tokens: Annotated[int, Field(ge=0)] = 0
    best_of: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, data):
        """A field given as null takes its default; a field this server cannot honour is
        refused by name unless its value asks for nothing (no tools, plain text)."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if v is not None}
        named = [k for k in UNSUPPORTED if k in data and not _asks_nothing(k, data[k])]
        if named:
            raise ValueError(f"{', '.join(named)}: not supported by this server")
        stops = data.get("stop")
        if isinstance(stops, list) and len(stops) > MOST_STOPS:  # (before each is validated)
            raise ValueError(STOPS_BOUND)
        return data

    @model_validator(mode="after")
    def _supported(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        if self.best_of not in (None, 1):
            raise ValueError(f"best_of must be 1, got {self.best_of}")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MOST_STOP_CHARS for s in stops):  # (their count: before, in _known)
            raise ValueError(STOPS_BOUND)
        if any(UNPAIRED.search(s) for s in stops):  # (no text ever holds one)
            raise ValueError("a stop string holds an unpaired surrogate (U+D800-U+DFFF), "
                             "which is not a character")  # fmt: skip
        return self

    def sampling(self, default_max_tokens: int, choice: int = 0) -> SamplingParams:
        """The engine's parameters of choice ``choice`` (of ``n``): a seeded request's
        choices take the seeds after its own, so they differ and repeat."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        temperature = 0.0 if self.temperature < GREEDY_BELOW else self.temperature
        seed = None if self.seed is None else (self.seed + choice) % 2**64
        return SamplingParams(max_new_tokens=self.max_tokens or default_max_tokens,
                              temperature=temperature, top_p=self.top_p,
                              top_k=max(self.top_k, 0), seed=seed, stop=stop,
                              ignore_eos=self.ignore_eos,
                              stop_token_ids=list(self.stop_token_ids),
                              repetition_penalty=self.repetition_penalty,
                              presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty,
                              min_tokens=self.min_tokens,
                              logprobs=self.top_logprobs_asked)  # fmt: skip

    @property
    def top_logprobs_asked(self) -> int | None:
        """The likeliest tokens whose log probabilities each token carries (None: none)."""
        return None

    @property
    def asked_max_tokens(self) -> int | None:
        """The new tokens the request names itself (None: it takes the default)."""
        named = {"max_tokens", "max_completion_tokens"} & self.model_fields_set
        return self.max_tokens if named else None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of one of them."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16  # (0: with echo, the prompt alone)
    echo: bool = False
    logprobs: TopLogprobs | None = None

    @property
    def top_logprobs_asked(self) -> int | None:
        return self.logprobs

    def sampling(self, default_max_tokens: int, choice: int = 0) -> SamplingParams:
        """As a chat's, and with ``echo`` the prompt tokens' log probabilities where asked
        for, computed by the first choice alone (the others reuse its prompt's pages, and
        the reply gives every choice the first's); ``max_tokens`` 0 computes one token that
        the answer leaves out."""
        params = super().sampling(default_max_tokens, choice)
        if self.max_tokens == 0:
            params.max_new_tokens = 1
        if self.echo and self.logprobs is not None and choice == 0:
            params.prompt_logprobs = self.logprobs
        return params

    @model_validator(mode="before")
    @classmethod
    def _one(cls, data):
        """Refuse, with one error before its items are validated (each item of a union's
        list a failure per shape, made on the event loop's thread), a list of several
        prompts, and token ids (alone or as the one prompt of a list) not all integers."""
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if not isinstance(prompt, list) or not prompt:
            return data
        first = prompt[0]
        if len(prompt) > 1 and not isinstance(first, int):
            raise ValueError("one prompt per request (a list of several is not supported)")
        ids = first if isinstance(first, list) else prompt if isinstance(first, int) else None
        if ids is not None and set(map(type, ids)) - {int}:  # (a C loop; bools refused too)
            raise ValueError("prompt: token ids must all be integers")
        return data

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            self.prompt = self.prompt[0]  # (a list of one: several were refused, in _one)
        if not self.prompt:
            raise ValueError("the prompt is empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 needs echo: true (the prompt alone)")
        if self.echo and self.stream:
            raise ValueError("echo is not supported with stream")
        return self


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = STRICT

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role,
                "content": content or ""}  # fmt: skip


def _content_parts(messages: list) -> int:
    """The content parts of a conversation's messages, as sent (before validation)."""
    return sum(len(m["content"]) for m in messages
               if isinstance(m, dict) and isinstance(m.get("content"), list))  # fmt: skip


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` through the tokenizer's chat template."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data):
        """Refuse more messages or content parts than :data:`MOST_MESSAGES` by the lists'
        lengths, before each is validated (a body of 15 MiB holds 500,000 empty messages:
        2.3 s of the event loop's thread)."""
        messages = data.get("messages") if isinstance(data, dict) else None
        if isinstance(messages, list) and (len(messages) > MOST_MESSAGES or
                                           _content_parts(messages) > MOST_MESSAGES):  # fmt: skip
            raise ValueError(f"a conversation takes at most {MOST_MESSAGES} messages and as "
                             f"many content parts")  # fmt: skip
        return data

    @model_validator(mode="after")
    def _chat(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def top_logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

"""The HTTP side: an OpenAI-compatible FastAPI app over an :class:`EngineLoop`.

``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` (bearer key when set),
``/health`` and ``/metrics`` (open). Every error is OpenAI's shape with a 4xx status (5xx
only when the engine itself stopped); a client that disconnects aborts its request, as
vLLM's ``with_cancellation`` does: the handler races a listener for the ASGI
``http.disconnect`` message.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from headspace.engine.outputs import RequestOutput
from headspace.engine.sampling import SamplingParams
from headspace.errors import UserError
from headspace.model.token_bytes import token_byte_reader
from headspace.server import protocol
from headspace.server.engine_loop import EngineLoop, log
from headspace.server.guard import Guard
from headspace.server.protocol import API_FIELDS, APIError, ChatRequest, CompletionRequest
from headspace.server.reply import Reply, new_id


@dataclass
class ServerOptions:
    """``served_model_name``: the name clients give as ``model``; ``api_key``: the bearer
    key of the ``/v1`` routes (None: open); ``max_body_bytes``: the largest request body."""

    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = 16 * 2**20
    default_max_tokens: int = 4096  # a chat request that gives none (completions: 16)


def _error(error: APIError, metrics=None) -> JSONResponse:
    if metrics is not None:
        metrics.error(error.status)
    return JSONResponse(error.body(), status_code=error.status)


# the members of a field's union, as pydantic tags its errors' places, in a client's words
UNION_MEMBERS = {"str": "a string", "list[int]": "a list of token ids",
                 "list[str]": "a list of strings", "list[list[int]]": "a list of token id lists",
                 "list[TextPart]": "a list of text parts"}  # fmt: skip


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    """The first error's message and the field at fault (None: the body as a whole); where
    a field takes one of several shapes, the shapes it takes, not each one's complaint."""
    places = [tuple(p for p in e.get("loc", ()) if p != "body") for e in error.errors()]
    first, loc = (error.errors()[0], places[0]) if places else ({}, ())
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}", None
    if not loc and isinstance(first.get("input"), bytes):
        return ("the body must be a JSON object sent with Content-Type: application/json "
                "(it was not read as JSON)"), None  # fmt: skip
    not_an_object = ("missing", "model_type", "dict_type", "model_attributes_type")
    if not loc and first.get("type") in not_an_object:  # (none, a list, null, a string)
        return "the body must be a JSON object of the request's fields", None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if not loc:  # (a check of the request as a whole)
        return message, None
    union = next((i for i, p in enumerate(loc) if p in UNION_MEMBERS), None)
    where = ".".join(str(p) for p in loc[:union])
    if union is not None:
        members = dict.fromkeys(p[union] for p in places if len(p) > union and
                                p[:union] == loc[:union] and p[union] in UNION_MEMBERS)  # fmt: skip
        words = [UNION_MEMBERS[m] for m in members]
        message = f"must be {', '.join(words[:-1])}{' or ' if words[1:] else ''}{words[-1]}"
    return f"{where}: {message}", str(loc[0])


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the ASGI ``http.disconnect`` message)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


GONE = 499  # the status of an answer whose client went away (nginx's "client closed request")


async def _unless_disconnected(request: Request, work) -> Response:
    """Run ``work`` (a coroutine) until done or the client disconnects (then cancelled:
    its request is aborted, and the answer nobody reads is 499)."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server shuts down: the request is aborted
        task.cancel()
        gone.cancel()
        return _error(APIError(503, "the server is shutting down", "server_error"))
    gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    return Response(status_code=GONE)


def build_app(engine_loop: EngineLoop, options: ServerOptions) -> FastAPI:
    """The app: routes over ``engine_loop``, which runs (and warms up) on its own thread."""

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        await asyncio.to_thread(engine_loop.stop)  # after the last connection, before exit

    app = FastAPI(title="headspace", docs_url=None, redoc_url=None, lifespan=lifespan)
    counted = engine_loop.metrics  # errors by status
    app.add_middleware(Guard, api_key=options.api_key, max_body_bytes=options.max_body_bytes,
                       refused=counted.error)  # fmt: skip
    engine = engine_loop.engine
    tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")  # one user at a time
    name = options.served_model_name
    created = int(time.time())

    def token_text(token: int) -> str:
        return engine.tokenizer.decode([token])

    token_bytes = token_byte_reader(engine.tokenizer)  # (None: their texts' bytes)

    @app.exception_handler(APIError)
    async def api_error(_, error: APIError):
        return _error(error, counted)

    @app.exception_handler(Exception)
    async def bug(_, error: Exception):  # still OpenAI's shape; the server keeps serving
        log.error("a request failed", exc_info=error)  # the text is the log's, not the client's
        return _error(APIError(500, "internal error (the server's log says why)",
                               "server_error"), counted)  # fmt: skip

    @app.exception_handler(RequestValidationError)
    async def invalid(_, error: RequestValidationError):
        message, param = _validation_message(error)
        return _error(APIError(400, message, param=param), counted)

    @app.exception_handler(HTTPException)
    async def http_error(_, error: HTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error(APIError(error.status_code, str(error.detail), kind), counted)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if engine_loop.error is not None:  # (the process is on its way out)
            return JSONResponse({"status": "error"}, 503)
        if engine_loop.draining:
            return JSONResponse({"status": "shutting down"}, 503)
        if not engine_loop.ready.is_set():
            return JSONResponse({"status": "warming up"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(engine_loop.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        card = {"id": name, "object": "model", "created": created, "owned_by": "headspace",
                "max_model_len": engine.max_context}  # fmt: skip
        return {"object": "list", "data": [card]}

    async def _tokens(body, chat: bool) -> list[int]:
        def encode():
            if chat:
                messages = [m.as_dict() for m in body.messages]
                _refuse_surrogates([m["content"] for m in messages])
                engine.check_chat(messages)  # before the whole text
                return engine.encode_chat(messages)
            if isinstance(body.prompt, str):
                _refuse_surrogates([body.prompt])
                engine.check_text([body.prompt])
                return engine.encode(body.prompt)
            vocab = engine.model.config.vocab_size
            if any(not 0 <= t < vocab for t in body.prompt):
                raise UserError(f"token ids must be in [0, {vocab})")
            return list(body.prompt)

        try:
            return await asyncio.get_running_loop().run_in_executor(tokenizing, encode)
        except Exception as error:  # noqa: BLE001 (text the tokenizer cannot take is the client's)
            if not isinstance(error, UserError):  # (its words stay in the log)
                log.warning("the tokenizer refused a request's text: %r", error)
            raise APIError(400, str(error) if isinstance(error, UserError) else
                           f"cannot tokenize the {'messages' if chat else 'prompt'}",
                           param="messages" if chat else "prompt") from None  # fmt: skip

    async def _serve(request: Request, body, chat: bool):
        if body.model != name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{name!r}", "not_found_error", "model")  # fmt: skip
        if body.n > engine_loop.bound:  # (never servable: not a 429, which says try again)
            raise APIError(400, f"n is {body.n}, past the {engine_loop.bound} requests this "
                           "server holds at once (each choice runs as a request)",
                           param="n")  # fmt: skip
        arrived = time.perf_counter()
        engine_loop.reserve(body.n)  # a place for each choice (429 or 503 before any work)
        try:
            ids = await _tokens(body, chat)
            _check_room(len(ids), body.asked_max_tokens, engine.max_context)
            params = [body.sampling(options.default_max_tokens, i) for i in range(body.n)]
            if body.asked_max_tokens is None:  # what the context leaves (a whole one: one)
                left = max(engine.max_context - len(ids), 1)
                params = [replace(p, max_new_tokens=min(p.max_new_tokens, left))
                          for p in params]  # fmt: skip
        except BaseException as error:
            engine_loop.release(body.n)
            if isinstance(error, UserError):
                raise APIError(400, str(error), param=_api_field(error.param, chat)) from None
            raise
        reply = Reply(new_id("chatcmpl" if chat else "cmpl"), name, chat,
                               token_text, token_bytes)  # fmt: skip
        if not chat and body.echo:
            text = body.prompt if isinstance(body.prompt, str) else engine.tokenizer.decode(ids)
            reply.echo, reply.hidden = (text, ids), body.max_tokens == 0
        choices = await _accepted(engine_loop, ids, params, arrived)
        if body.stream:
            return StreamingResponse(_events(choices, reply, body.include_usage),
                                     media_type="text/event-stream")  # fmt: skip

        async def whole():
            finals = await asyncio.gather(*(_last(outputs) for outputs in choices))
            # made and serialised on a thread: a reply of many choices and log probabilities
            # (tens of MB) would hold every stream's event loop for seconds
            content = await asyncio.to_thread(_json_bytes, reply.completion, list(finals))
            return Response(content, media_type="application/json")

        answer = await _unless_disconnected(request, whole())
        if answer.status_code == GONE:  # (nobody reads it: the log and the metrics do)
            log.info("a client went away before its answer; its request was aborted (%d)", GONE)
            counted.error(GONE)
        return answer

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await _serve(request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        return await _serve(request, body, chat=True)

    return app


def _json_bytes(make, *args) -> bytes:
    """``make(*args)``, a response with ``choices``, as JSON (as ``JSONResponse`` writes
    it), a choice at a time: one call of the C encoder holds the GIL until it returns, so
    a reply of tens of MB in one call would hold the event loop for a second."""
    content = make(*args)
    choices = content.pop("choices")
    dump = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False,
                             separators=(",", ":"))  # fmt: skip
    text = dump(content)[:-1] + ',"choices":[' + ",".join(dump(c) for c in choices) + "]}"
    return text.encode("utf-8")


def _api_field(param: str | None, chat: bool) -> str | None:
    """The request field of an engine's sampling field (a chat names ``logprobs``'s count
    ``top_logprobs``)."""
    if chat and param == "logprobs":
        return "top_logprobs"
    return API_FIELDS.get(param, param)


def _refuse_surrogates(texts: list[str]) -> None:
    """A one-line UserError for text holding an unpaired surrogate (JSON's escapes let
    one through; no tokenizer takes it)."""
    if any(protocol.UNPAIRED.search(text) for text in texts):
        raise UserError(
            "the text holds an unpaired surrogate (U+D800-U+DFFF), which is not a "
            "character: send UTF-8 text"
        )


def _check_room(prompt_tokens: int, asked: int | None, context: int) -> None:
    """A 400 with the numbers when the new tokens a request names do not fit the context
    beside its prompt (one that names none gets what the context leaves; a prompt past the
    context is the engine's to refuse)."""
    if asked is None or prompt_tokens >= context or prompt_tokens + asked <= context:
        return
    raise APIError(400, f"max_tokens is {asked}, but the prompt's {prompt_tokens} tokens "
                   f"leave {context - prompt_tokens} of the context's {context}",
                   param="max_tokens")  # fmt: skip


async def _first(outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    try:
        return await outputs.__anext__()
    except StopAsyncIteration:
        return None


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    final = None
    async for output in outputs:
        final = output
    return final


async def _accepted(engine_loop: EngineLoop, ids: list[int], params: list[SamplingParams],
                    arrived: float) -> list[AsyncIterator[RequestOutput]]:  # fmt: skip
    """Each choice's outputs once the engine has accepted it (a refusal is a status, before
    any event: the choices already accepted are aborted, the places of the others given
    back)."""
    choices = []
    try:
        for choice in params:
            outputs = engine_loop.generate(ids, choice, arrived)
            choices.append(outputs)
            await _first(outputs)  # (None: accepted; a refusal raises APIError)
    except BaseException:
        for outputs in choices:
            await outputs.aclose()
        engine_loop.release(len(params) - len(choices))
        raise
    return choices


async def _events(choices: list[AsyncIterator[RequestOutput]], reply: Reply,
                  include_usage: bool) -> AsyncIterator[str]:  # fmt: skip
    """Server-sent events: a chunk per step and choice with new text (a chat's first of each
    choice carries the role), the finish reason on each choice's last, the usage chunk if
    asked, then ``[DONE]``. When the client goes, starlette cancels this generator and the
    requests are aborted."""

    def event(payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    merged: asyncio.Queue = asyncio.Queue()  # (choice, output or APIError or None: it ended)
    # a choice's next output is taken only once its last one is sent: a client that stops
    # reading holds one a choice here, the outbox merging the rest into one (queued, each
    # would hold every token so far: memory growing with the square of the tokens)
    sent = [asyncio.Semaphore(1) for _ in choices]

    async def pump(index: int, outputs: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in outputs:
                await sent[index].acquire()
                merged.put_nowait((index, output))
        except APIError as error:  # the engine stopped, or the server ends it
            merged.put_nowait((index, error))
        finally:
            merged.put_nowait((index, None))

    finals: list[RequestOutput | None] = [None] * len(choices)
    pumps = [asyncio.ensure_future(pump(i, outputs)) for i, outputs in enumerate(choices)]
    try:
        if reply.chat:
            for index in range(len(choices)):
                yield event(reply.chunk("", None, role=True, index=index))
        running, failed = len(choices), None
        while running:
            index, item = await merged.get()
            if item is None:
                running -= 1
            elif isinstance(item, APIError):
                failed = failed or item
            else:
                if item.new_text or item.finish_reason or item.new_logprobs:
                    yield event(reply.chunk(item.new_text, item.finish_reason, index=index,
                                            logprobs=item.new_logprobs))  # fmt: skip
                finals[index] = item
                sent[index].release()
        if failed is not None:
            yield event(failed.body())
    finally:  # also when the client has gone: its requests are aborted now (each pump's
        for task in pumps:  # generator aborts its request as the cancellation unwinds it)
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
    if include_usage and failed is None and all(f is not None for f in finals):
        yield event(reply.usage_chunk(finals))
    yield "data: [DONE]\n\n"

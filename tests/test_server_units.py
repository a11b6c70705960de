"""The server's parts without a process: the outbox between the engine thread and a
request's task, and the request shapes' checks."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from pydantic import ValidationError

from headspace.engine.outputs import RequestOutput
from headspace.server.outbox import Outbox
from headspace.server.protocol import APIError, ChatRequest, CompletionRequest
from headspace.server.reply import Reply


def _output(ids: list[int], new: list[int], reason: str | None = None) -> RequestOutput:
    text, new_text = "".join(f"t{i}" for i in ids), "".join(f"t{i}" for i in new)
    return RequestOutput("p", text, list(ids), reason, new_text=new_text,
                         new_token_ids=list(new))  # fmt: skip


def test_the_outbox_merges_outputs_and_keeps_control_items_in_order():
    async def run() -> list:
        box = Outbox(asyncio.get_running_loop())

        def engine_thread():  # what a slow reader finds: one output for three steps
            box.put(None)  # accepted
            for n in range(1, 4):
                box.put(_output(list(range(n)), [n - 1]))

        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
        first = await box.take()
        box.put(_output([0, 1, 2, 3], [3], "length"))
        box.put(APIError(500, "stopped"))
        return first + await box.take()

    items = asyncio.run(run())
    assert items[0] is None
    assert items[1].new_token_ids == [0, 1, 2] and items[1].new_text == "t0t1t2"
    assert items[1].token_ids == [0, 1, 2]  # the latest output, with every new token since
    assert items[2].finish_reason == "length" and items[2].new_token_ids == [3]
    assert isinstance(items[3], APIError)


def test_a_reply_keeps_one_id_and_time_across_its_chunks():
    reply = Reply("cmpl-1", "m", chat=True, created=123)
    chunks = [reply.chunk("", None, role=True), reply.chunk("a", None), reply.chunk("b", "stop")]
    assert {(c["id"], c["created"], c["object"]) for c in chunks} == {
        ("cmpl-1", 123, "chat.completion.chunk")}  # fmt: skip
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[2]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("fields", [
    {"n": 17}, {"seed": 2**64}, {"tools": [{"type": "function"}]}, {"best_of": 3},
    {"stream_options": {"include_usage": True}}, {"presence_penalty": 2.5}, {"stop": [""]},
    {"temperature": 2.5}, {"top_p": 0}, {"max_tokens": 0}, {"prompt": ["a", "b"]},
    {"repetition_penalty": 200}, {"min_tokens": -1}, {"frequency_penalty": True},
    # types as OpenAI's: no string, boolean or fraction taken for a number
    {"max_tokens": True}, {"max_tokens": "3"}, {"max_tokens": 3.0}, {"n": True},
    {"temperature": True}, {"top_p": "1"}, {"top_k": True}, {"seed": True}, {"seed": 1.5},
    {"prompt": [True, False]}, {"stop": 3}, {"stop_token_ids": [True]}, {"echo": 1},
    {"stream": True, "stream_options": {"include_usage": "yes"}},
])  # fmt: skip
def test_what_cannot_be_honoured_is_refused(fields):
    with pytest.raises(ValidationError):
        CompletionRequest(**({"model": "m", "prompt": "hi"} | fields))


EMPTY, PART, BAD = {"role": "user", "content": ""}, {"type": "text", "text": ""}, {"x": 1}


@pytest.mark.parametrize(("request_type", "field", "at_bound", "past_it", "refusal"), [
    (ChatRequest, "messages", [EMPTY] * 16384, [EMPTY] * 16384 + [BAD],
     "at most 16384 messages"),
    (ChatRequest, "messages", [{"role": "user", "content": [PART] * 16384}],
     [{"role": "user", "content": [PART] * 16384 + [BAD]}], "as many content parts"),
    (CompletionRequest, "stop", ["a"] * 64, ["a"] * 64 + [7], "at most 64 strings"),
    (CompletionRequest, "prompt", ["a"], ["a", 7], "one prompt per request"),
    (CompletionRequest, "prompt", [0] * 1000, [0] + ["x"] * 1000, "all be integers"),
    (CompletionRequest, "prompt", [[0] * 1000], [[0] + ["x"] * 1000], "all be integers"),
])  # fmt: skip
def test_a_list_past_its_bound_is_refused_by_its_length_before_its_items(
        request_type, field, at_bound, past_it, refusal):  # fmt: skip
    """A list at its bound is taken; with one more item, itself invalid, the refusal names
    the bound, not the item: the items were not validated one by one (on the event loop's
    thread, which every client waits for). Token ids with other items among them: one
    error, not one for each item and shape of the prompt's union."""
    base = {"model": "m"} if request_type is ChatRequest or field == "prompt" else \
        {"model": "m", "prompt": "hi"}  # fmt: skip
    request_type.model_validate(base | {field: at_bound})
    with pytest.raises(ValidationError, match=refusal) as refused:
        request_type.model_validate(base | {field: past_it})
    assert refused.value.error_count() == 1  # (not one an item, or one an item and shape)


def test_sampling_fields_become_sampling_params():
    body = '{"model": "m", "prompt": [1], "temperature": 0, "top_p": 1, "presence_penalty": -2}'
    whole = CompletionRequest.model_validate_json(body)  # (JSON integers pass for numbers)
    assert (whole.temperature, whole.top_p, whole.presence_penalty) == (0.0, 1.0, -2.0)
    request = CompletionRequest(model="m", prompt=[1, 2], temperature=1e-30, top_k=-1,
                                stop="END", seed=2**64 - 1)  # fmt: skip
    params = request.sampling(4096)
    assert params.temperature == 0 and params.top_k == 0 and params.stop == ["END"]
    assert params.max_new_tokens == 16  # OpenAI's default for completions
    assert [request.sampling(4096, i).seed for i in range(3)] == [2**64 - 1, 0, 1]  # (n)
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        max_completion_tokens=7)  # fmt: skip
    assert chat.sampling(4096).max_new_tokens == 7
    assert chat.messages[0].as_dict() == {"role": "user", "content": "a\nb"}
    assert ChatRequest(model="m", messages=[{"role": "user", "content": "x"}]).sampling(
        4096).max_new_tokens == 4096  # fmt: skip


def test_an_echoed_prompt_is_scored_by_the_first_choice_and_shown_in_every_one():
    """With echo and logprobs, only choice 0 computes the prompt's log probabilities (the
    others reuse its pages); the reply gives each choice the first one's."""
    from headspace.engine.outputs import TokenLogprob

    request = CompletionRequest(model="m", prompt="x", echo=True, logprobs=1, n=2,
                                max_tokens=0)  # fmt: skip
    assert [request.sampling(16, i).prompt_logprobs for i in range(2)] == [1, None]
    first, second = _output([5], [9], "length"), _output([5], [8], "length")
    first.prompt_logprobs = [None, TokenLogprob(6, -0.5, ((6, -0.5),))]
    first.logprobs, second.logprobs = [], []  # (asked for; the generated token hidden)
    reply = Reply("r", "m", chat=False, echo=("t5t6", [5, 6]), hidden=True)
    choices = reply.completion([first, second])["choices"]
    assert [c["logprobs"]["token_logprobs"] for c in choices] == [[None, -0.5]] * 2


def test_an_echoed_prompts_log_probabilities_are_named_once_for_every_choice():
    """With echo and logprobs over n choices, the prompt's part of each choice's lists is
    the same, made once (each of its tokens named once, not once a choice), and each
    choice's generated tokens follow it, their offsets after the prompt's text."""
    from headspace.engine.outputs import TokenLogprob

    named = []

    def token_text(token: int) -> str:
        named.append(token)
        return f"t{token}"

    prompt = [None, TokenLogprob(6, -0.5, ((6, -0.5), (7, -1.5)))]
    outputs = [_output([9 - i], [9 - i], "length") for i in range(3)]
    for i, output in enumerate(outputs):
        output.logprobs = [TokenLogprob(9 - i, -0.25, ((9 - i, -0.25),))]
    outputs[0].prompt_logprobs = prompt
    reply = Reply("r", "m", chat=False, token_text=token_text, echo=("t5t6", [5, 6]))
    choices = reply.completion(outputs)["choices"]
    assert len(named) == 2 + 2 + 3 * 2  # the prompt's tokens and tops once; 3 choices' own
    for i, choice in enumerate(choices):
        logprobs = choice["logprobs"]
        assert choice["text"] == f"t5t6t{9 - i}"
        assert logprobs["tokens"] == ["t5", "t6", f"t{9 - i}"]
        assert logprobs["token_logprobs"] == [None, -0.5, -0.25]
        assert logprobs["text_offset"] == [0, 2, 4]


def test_a_chats_logprobs_give_each_tokens_own_bytes():
    """A character split over two tokens: each token's ``bytes`` are its own (joined, they
    are the character's), not those of the replacement character its text shows."""
    from headspace.engine.outputs import TokenLogprob

    own = {1: "中".encode()[:2], 2: "中".encode()[2:]}
    reply = Reply("r", "m", chat=True, token_text=lambda t: "\ufffd",
                  token_bytes=own.__getitem__)  # fmt: skip
    output = _output([1, 2], [1, 2], "stop")
    output.logprobs = [TokenLogprob(t, -0.5, ((t, -0.5),)) for t in (1, 2)]
    content = reply.completion([output])["choices"][0]["logprobs"]["content"]
    assert bytes(sum((entry["bytes"] for entry in content), [])).decode() == "中"
    assert content[0]["top_logprobs"][0]["bytes"] == list(own[1])


def test_a_whole_reply_is_the_json_of_its_content_written_a_choice_at_a_time():
    """The body of a whole (not streamed) reply, written on a thread a choice at a time,
    reads back as its content; non-ASCII text stays as it is, as JSONResponse writes it."""
    from headspace.server.app import _json_bytes

    content = {"id": "r", "object": "text_completion", "created": 1, "model": "m",
               "choices": [{"index": i, "text": f"✓ {i}", "logprobs": None}
                           for i in range(3)], "usage": {"total_tokens": 3}}  # fmt: skip
    body = _json_bytes(lambda: json.loads(json.dumps(content)))
    assert json.loads(body) == content and "✓".encode() in body
    with pytest.raises(ValueError):  # (as JSONResponse: no NaN in JSON)
        _json_bytes(lambda: {"id": "r", "choices": [{"logprob": float("nan")}]})


def test_nulls_take_defaults_and_harmless_values_pass():
    request = CompletionRequest(model="m", prompt="x", temperature=None, top_p=None, n=None,
                                stream=None, tools=[], tool_choice="none",
                                response_format={"type": "text"})  # fmt: skip
    assert request.temperature == 1.0 and request.n == 1 and request.stream is False
    with pytest.raises(ValidationError, match="tool_choice"):
        CompletionRequest(model="m", prompt="x", tool_choice="auto")


def test_the_engine_loop_takes_the_heap_out_of_the_collectors_view_before_it_serves(tiny_llama):
    """A full garbage collection between two steps would walk everything the process holds
    and stall every stream: the loop freezes what exists when it starts, before it is ready
    (the collector no longer lists an object made before the start; one made after, it
    does)."""
    import gc

    from headspace import LLM
    from headspace.server.engine_loop import EngineLoop
    from headspace.server.metrics import Metrics

    loop = EngineLoop(LLM(str(tiny_llama), device="cpu").engine, Metrics("tiny"), 1, 0)
    made_before = [object()]  # a list: tracked by the collector
    gc.unfreeze()
    try:
        loop.start(warm_up=False)
        assert loop.ready.wait(60) and loop.error is None
        made_after = [object()]
        listed = gc.get_objects()
        assert not any(o is made_before for o in listed)
        assert any(o is made_after for o in listed)
    finally:
        loop.stop()
        gc.unfreeze()  # the test process's other objects back in view


def test_the_outbox_merges_log_probabilities_with_their_tokens():
    from headspace.engine.outputs import TokenLogprob

    async def run() -> list:
        box = Outbox(asyncio.get_running_loop())
        for n in range(1, 3):
            output = _output(list(range(n)), [n - 1])
            output.new_logprobs = [TokenLogprob(n - 1, -float(n))]
            box.put(output)
        return await box.take()

    (merged,) = asyncio.run(run())
    assert merged.new_logprobs == [TokenLogprob(0, -1.0), TokenLogprob(1, -2.0)]


def test_a_stream_whose_client_stops_reading_takes_no_more_outputs_from_its_choices():
    """A client that reads one event and stops (its socket full): the stream takes at most a
    couple of outputs a choice more while it waits (the outbox merges the rest into one),
    not every output the engine makes; read on, it gets every token in order."""
    from headspace.server.app import _events

    made = [0, 0]

    async def choice(index: int):
        for n in range(1, 201):  # an engine far faster than its reader
            made[index] = n
            yield _output(list(range(n)), [n - 1], "length" if n == 200 else None)

    async def run() -> tuple[list[int], str]:
        reply = Reply("cmpl-1", "m", chat=False, created=1)
        events = _events([choice(0), choice(1)], reply, include_usage=False)
        first = await events.__anext__()
        for _ in range(50):  # the client reads nothing while the loop runs on
            await asyncio.sleep(0)
        taken = list(made)
        rest = [first] + [e async for e in events]
        return taken, "".join(rest)

    taken, body = asyncio.run(run())
    assert max(taken) <= 3  # queued without bound before: all 200 of each choice
    texts = ["".join(c["text"] for e in body.split("data: ")[1:-1]
                     for c in json.loads(e)["choices"] if c["index"] == i)
             for i in range(2)]  # fmt: skip
    assert texts == ["".join(f"t{n}" for n in range(200))] * 2 and body.endswith("[DONE]\n\n")

"""One request never stops the server for the others: values the sampler cannot take are
refused, a request whose logits stop being finite ends alone, and a fault that stops the
engine ends the process (non-zero, for a supervisor), never a server that answers 503 for
good. Tried as users use it: ``tests/hooked_server.py`` (``headspace serve`` with engine
hooks) as a process on 127.0.0.1, driven by the ``openai`` client and raw HTTP."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from headspace import LLM, SamplingParams
from hooked_server import FATAL, POISON, POISONED_FROM
from server_process import ServerProcess

NAME = "smol"
HOOKED = [sys.executable, str(Path(__file__).parent / "hooked_server.py")]
PROMPTS = ["The lighthouse keeper", "Once upon a time", "The harbour at dawn"]
TOKENS = 40


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--served-model-name", NAME, program=HOOKED)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def alone() -> list[str]:
    """Each of ``PROMPTS``' greedy text, run alone in this process."""
    llm = LLM()
    return [llm.generate(p, SamplingParams(max_new_tokens=TOKENS))[0].text for p in PROMPTS]


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _streamed(server, prompt: str) -> str:
    stream = _client(server).completions.create(model=NAME, prompt=prompt, max_tokens=TOKENS,
                                                temperature=0, stream=True)  # fmt: skip
    return "".join(chunk.choices[0].text for chunk in stream)


def _while_others_stream(server, bad) -> tuple[list[str], object]:
    """``bad()`` sent while ``PROMPTS`` stream; (their texts, what ``bad`` returned)."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        others = [pool.submit(_streamed, server, prompt) for prompt in PROMPTS]
        result = bad()
        return [other.result() for other in others], result


def _events(server, body: dict) -> list[str]:
    """The data lines of a streamed completion, as sent."""
    body = {"model": NAME, "stream": True, **body}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as reply:
        assert reply.status_code == 200
        return [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]


def test_an_underflowing_top_p_is_refused_and_the_others_stream_on(server, alone):
    def bad():
        return httpx.post(server.url + "/v1/completions", timeout=60,
                          json={"model": NAME, "prompt": "hi", "top_p": 1e-46})  # fmt: skip

    texts, reply = _while_others_stream(server, bad)
    assert reply.status_code == 400, reply.text
    assert "float32" in reply.json()["error"]["message"]
    assert reply.json()["error"]["param"] == "top_p"
    assert texts == alone
    assert server.healthy()


def _rss_bytes(server) -> int:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024


def test_a_huge_prompt_or_stop_list_is_refused_before_it_costs(server, alone):
    """A 15 MiB prompt (under the 16 MiB body bound), of words or of one run of characters
    with no space to cut at, conversations of 500,000 empty user or system messages (more
    than a conversation may hold) and one of 2,000 empty tool messages (each at
    least the template's tokens for one: "at least"), are each refused without being
    tokenized whole, and so are 70,000 stop strings, while others stream; memory stays as
    it was."""
    before = _rss_bytes(server)
    words = "lighthouse keeper harbour dawn " * (15 * 2**20 // 31)
    empty = [
        [{"role": role, "content": ""}] * count
        for role, count in (("user", 500_000), ("system", 500_000), ("tool", 2000))
    ]
    bodies = [("completions", {"prompt": words}), ("completions", {"prompt": "a" * 15 * 2**20}),
              *[("chat/completions", {"messages": messages}) for messages in empty]]  # fmt: skip

    def bad():
        refused = []
        for route, body in bodies:
            started = time.monotonic()
            reply = httpx.post(f"{server.url}/v1/{route}", timeout=120,
                               json={"model": NAME, **body})  # fmt: skip
            refused.append((reply, time.monotonic() - started))
        many = {"model": NAME, "prompt": "hi", "stop": ["x"] * 70_000}
        stops = httpx.post(server.url + "/v1/completions", json=many, timeout=60)
        return refused, stops

    texts, (refused, stops) = _while_others_stream(server, bad)
    for reply, seconds in refused:  # (tokenized whole: 15.6 s, 15.8 s and about 15 s)
        assert reply.status_code == 400, reply.text
        assert seconds < 5, seconds
    for reply, _ in refused[:2] + refused[-1:]:
        assert "does not fit the context" in reply.text
    for reply, _ in refused[2:4]:  # (by the list's length, before each message's validation)
        assert "at most 16384 messages" in reply.text
    assert "has at least" in refused[-1][0].text  # (its lower bound, not the whole count)
    assert stops.status_code == 400 and "at most 64" in stops.text
    assert texts == alone
    assert _rss_bytes(server) < 1.1 * before
    assert server.healthy()


def test_non_finite_logits_end_that_request_alone(server, alone):
    def bad():
        return _events(server, {"prompt": POISON, "max_tokens": 30, "temperature": 0,
                                "ignore_eos": True})  # fmt: skip

    texts, events = _while_others_stream(server, bad)
    assert texts == alone
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "not finite" in error["message"]
    pieces = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert 0 < len(pieces) < POISONED_FROM  # the tokens before the poison came through
    with pytest.raises(openai.InternalServerError, match="not finite"):  # not streamed
        _client(server).completions.create(model=NAME, prompt=POISON, max_tokens=30)
    assert server.healthy()
    assert _streamed(server, PROMPTS[0]) == alone[0]
    assert server.metrics()['headspace_requests_finished_total{reason="error"}'] >= 2


def test_a_fault_that_stops_the_engine_ends_the_process(alone):
    """Its requests get an error (a stream: an error event, then [DONE]) that does not
    show the fault's text, and the process exits with 1, so that a supervisor restarts
    it."""
    server = ServerProcess("--served-model-name", NAME, program=HOOKED)
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 4000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=300) as running:  # fmt: skip
            lines = (line[6:] for line in running.iter_lines() if line.startswith("data: "))
            assert json.loads(next(lines))["choices"]  # it streams
            fatal = httpx.post(server.url + "/v1/completions", timeout=60,
                               json={"model": NAME, "prompt": FATAL, "max_tokens": 4})  # fmt: skip
            events = list(lines)
        assert fatal.status_code == 500
        assert "test" not in fatal.text and "RuntimeError" not in fatal.text
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 500
        assert server.process.wait(timeout=60) == 1
        assert "exiting" in server.output()
    finally:
        server.stop()


def test_a_request_with_no_room_for_its_pages_ends_alone(alone):
    """Three streams outgrow 8 KV pages of 16 tokens, and the host budget (1 KiB) has no
    room to swap one out: the one that finds no page ends with a 503 error event and
    [DONE] (a full server: sent again later, it may run), the others stream on to their
    text run alone, and the server keeps serving. A request whose ``n`` is past what the
    server holds at once could never run: a 400 naming ``n``, not a 429 (try again)."""
    bounds = ("--max-concurrent-requests", "3", "--max-queued-requests", "1")
    server = ServerProcess("--served-model-name", NAME, "--num-kv-pages", "8", "--page-size",
                           "16", "--host-memory", "1KiB", "--no-warm-up", *bounds)  # fmt: skip
    try:
        body = {"max_tokens": TOKENS, "temperature": 0}
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            runs = list(pool.map(lambda p: _events(server, {**body, "prompt": p}), PROMPTS))
        ended = [i for i, events in enumerate(runs) if "error" in json.loads(events[-2])]
        assert ended and len(ended) < len(PROMPTS)
        for i, events in enumerate(runs):
            assert events[-1] == "[DONE]"
            if i in ended:
                error = json.loads(events[-2])["error"]
                assert error["code"] == 503 and "ran out of KV cache memory" in error["message"]
            else:
                assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) \
                    == alone[i]  # fmt: skip
        assert server.healthy()
        assert _streamed(server, PROMPTS[0]) == alone[0]
        assert "no host page to swap it out to" in server.output()
        with pytest.raises(openai.BadRequestError) as caught:
            _client(server).completions.create(model=NAME, prompt="Hi", max_tokens=2, n=5)
        assert caught.value.body["param"] == "n" and "past the 4 requests" in str(caught.value)
    finally:
        server.stop()

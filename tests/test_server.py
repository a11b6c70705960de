"""``headspace serve`` tried as users use it: a process on 127.0.0.1 serving the embedded
model, driven with the ``openai`` client (and raw HTTP for what the client will not send)."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from headspace import LLM, SamplingParams
from server_process import ServerProcess

KEY, NAME = "test-key", "smol"
RUNNING, QUEUED = 8, 16  # the server's bounds: in the engine, and waiting beyond
NO_EOS = {"ignore_eos": True}
DOCUMENT = (Path(__file__).parents[1] / "docs" / "demo_document.txt").read_text()


@pytest.fixture(scope="module")
def server():
    process = ServerProcess("--api-key", KEY, "--served-model-name", NAME,
                            "--max-concurrent-requests", str(RUNNING),
                            "--max-queued-requests", str(QUEUED))  # fmt: skip
    yield process
    output = process.stop()
    assert "Traceback" not in output, output


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()  # the server's engine: the embedded model on the CPU, default options


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n)


def _ask_together(client: openai.OpenAI, prompts: list[str], max_tokens: int) -> list[str]:
    """Each prompt's greedy completion, all sent at once (a thread each)."""

    def ask(prompt: str) -> str:
        return client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens,
                                         temperature=0).choices[0].text  # fmt: skip

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(ask, prompts))


def _wait_until(condition, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def _idle(server) -> bool:
    m = server.metrics()
    return (m['headspace_requests_running'] == 0 and m['headspace_requests_waiting'] == 0
            and m['headspace_kv_pages_in_use{tier="gpu"}'] == 0
            and m['headspace_kv_pages_in_use{tier="host"}'] == 0)  # fmt: skip


def _aborted(server) -> float:
    return server.metrics().get('headspace_requests_finished_total{reason="abort"}', 0.0)


def test_completion_and_chat_equal_generate(client, llm):
    prompt = "The lighthouse keeper climbed the stairs and"
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0)
    alone = llm.generate(prompt, _greedy(24))[0]
    assert reply.choices[0].text == alone.text
    assert reply.usage.completion_tokens == len(alone.token_ids)
    assert reply.usage.prompt_tokens == len(llm.engine.encode(prompt))
    question = "What is a lighthouse for?"
    messages = [{"role": "user", "content": question}]
    chat = client.chat.completions.create(model=NAME, temperature=0, max_tokens=24,
                                          messages=messages)  # fmt: skip
    assert chat.choices[0].message.content == llm.generate(question, _greedy(24), chat=True)[0].text
    assert chat.choices[0].message.role == "assistant"


def test_streaming_gives_the_same_text_chunk_by_chunk_and_usage(client, llm):
    question = "Name three colours."
    stream = client.chat.completions.create(
        model=NAME, temperature=0, max_tokens=20, stream=True,
        stream_options={"include_usage": True}, messages=[{"role": "user", "content": question}],
    )  # fmt: skip
    chunks = list(stream)
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    alone = llm.generate(question, _greedy(20), chat=True)[0]
    assert len(pieces) > 3 and "".join(pieces) == alone.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(alone.token_ids)
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    stream = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=12,
                                       temperature=0, stream=True)  # fmt: skip
    text = "".join(c.choices[0].text for c in stream)
    assert text == llm.generate("Once upon a time", _greedy(12))[0].text


def test_models_lists_the_served_name(client, server):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_sixteen_concurrent_clients_get_what_each_gets_alone(client, llm):
    words = DOCUMENT.split()
    prompts = [" ".join(words[i * 7 : i * 7 + 5 + 11 * i]) for i in range(16)]

    assert _ask_together(client, prompts, 8) == [llm.generate(p, _greedy(8))[0].text
                                                 for p in prompts]  # fmt: skip


def test_a_shared_prefix_reports_cached_tokens(client):
    document = DOCUMENT[:3000]
    first = client.completions.create(model=NAME, prompt=document + "\nQ: Who?", max_tokens=2)
    assert first.usage.prompt_tokens > 256
    second = client.completions.create(model=NAME, prompt=document + "\nQ: Where?", max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens >= 128  # whole pages reused


def test_a_client_that_goes_away_aborts_its_request(client, server):
    aborted = _aborted(server)
    stream = client.completions.create(model=NAME, prompt="Count: one, two,", max_tokens=2000,
                                       stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    for _, _ in zip(range(3), stream, strict=False):
        pass
    stream.close()
    assert _wait_until(lambda: _aborted(server) == aborted + 1)
    assert _wait_until(lambda: _idle(server))
    gone = server.metrics().get('headspace_request_errors_total{status="499"}', 0.0)
    with pytest.raises(httpx.TimeoutException):  # not streaming: the client times out
        httpx.post(server.url + "/v1/completions", timeout=3,
                   headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": NAME, "prompt": "Count:", "max_tokens": 3000,
                         "ignore_eos": True})  # fmt: skip
    assert _wait_until(lambda: _aborted(server) == aborted + 2)
    errors = 'headspace_request_errors_total{status="499"}'
    assert _wait_until(lambda: server.metrics().get(errors) == gone + 1)  # counted, not read
    assert _wait_until(lambda: _idle(server))
    assert client.completions.create(model=NAME, prompt="Still", max_tokens=3).choices[0].text


BAD = {  # name: (request body or raw text, status)
    "malformed JSON": ('{"model": "smol", "prompt": ', 400),
    "max_tokens -1": ({"max_tokens": -1}, 400),
    "max_tokens of a wrong type": ({"max_tokens": "many"}, 400),
    "temperature -1": ({"temperature": -1}, 400),
    "top_p 2": ({"top_p": 2}, 400),
    "top_p NaN": ('{"model": "smol", "prompt": "Hello", "top_p": NaN, "max_tokens": 4}', 400),
    "n 0": ({"n": 0}, 400),
    "n past 16": ({"n": 17}, 400),
    "an unknown model": ({"model": "gpt-5"}, 404),
    "a prompt over the context": ({"prompt": "word " * 9000}, 400),
    "no prompt": ({"prompt": None}, 400),
    "a seed past 64 bits": ({"seed": 2**64}, 400),
    "a lone surrogate": ('{"model": "smol", "prompt": "hi \\ud800", "max_tokens": 2}', 400),
    "a stop string of a lone surrogate": (
        '{"model": "smol", "prompt": "hi", "stop": "\\ud800", "max_tokens": 2}',
        400,
    ),
    "token ids past the vocabulary": ({"prompt": [1, 2, 10**9]}, 400),
    "tools": ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400),
    "stream_options without stream": ({"stream_options": {"include_usage": True}}, 400),
    "stream given as a string": ({"stream": "yes"}, 400),
    "max_tokens given as true": ({"max_tokens": True}, 400),
    "n given as a string": ({"n": "2"}, 400),
    "a prompt of a wrong type": ({"prompt": 5}, 400),
    "an empty body": ("", 400),
    "a JSON list for a body": ("[1, 2]", 400),
    "max_tokens past the context": ({"max_tokens": 10**9}, 400),
    "repetition_penalty 0": ({"repetition_penalty": 0}, 400),
    "presence_penalty past 2": ({"presence_penalty": 2.5}, 400),
    "min_tokens past max_tokens": ({"min_tokens": 5}, 400),
    "min_tokens given as a boolean": ({"min_tokens": False}, 400),
    "a negative stop token id": ({"stop_token_ids": [-1]}, 400),
    "a chunked body past --max-body-size": (iter([b" " * 2**20] * 17), 413),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_request_gets_its_status_and_the_server_keeps_serving(server, case):
    body, status = BAD[case]
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    if isinstance(body, dict):
        body = {"model": NAME, "prompt": "Hello", "max_tokens": 4} | body
        body = {k: v for k, v in body.items() if v is not None}
        reply = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=60)
    else:  # raw text, or a generator (sent chunked, with no Content-Length)
        reply = httpx.post(server.url + "/v1/completions", content=body, headers=headers,
                           timeout=60)  # fmt: skip
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    if case == "malformed JSON":  # no field is at fault
        assert error["param"] is None and "not valid JSON" in error["message"]
    if case == "a lone surrogate":  # said in the server's words, not the tokenizer's
        assert "unpaired surrogate" in error["message"] and error["param"] == "prompt"
    if case == "a stop string of a lone surrogate":  # (it could never match: not text)
        assert "unpaired surrogate" in error["message"]
    if case == "top_p NaN":  # not "less than or equal to 1"
        assert "finite" in error["message"] and error["param"] == "top_p"
    if case == "a prompt of a wrong type":  # the shapes it takes, in a client's words
        assert error["message"] == ("prompt: must be a string, a list of token ids, a list "
                                    "of strings or a list of token id lists"), error  # fmt: skip
    if case in ("an empty body", "a JSON list for a body"):
        assert error["param"] is None and "JSON object" in error["message"], error
    if case == "min_tokens past max_tokens":  # (refused by the engine's own check)
        assert error["param"] == "min_tokens" and "asked for (4)" in error["message"]
        assert "max_new_tokens" not in error["message"]  # (the engine's word for max_tokens)
    assert server.healthy()


def test_a_json_body_not_sent_as_json_is_told_how_to_send_it(server):
    """A JSON body sent without ``Content-Type: application/json`` (curl's ``-d`` sends
    form-encoded, some clients text/plain) is not read as JSON: the 400 says what to send."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = '{"model": "smol", "prompt": "Hello", "max_tokens": 2}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded"):
        reply = httpx.post(server.url + "/v1/completions", content=body, timeout=60,
                           headers=headers | {"Content-Type": content_type})  # fmt: skip
        assert reply.status_code == 400, reply.text
        assert "Content-Type: application/json" in reply.json()["error"]["message"]
    assert server.healthy()


def test_max_tokens_past_the_context_gets_the_numbers_and_values_that_ask_nothing_pass(client):
    """An explicit max_tokens that does not fit beside the prompt: 400 with the numbers (chat
    and completions); fields this server cannot honour pass where their value asks nothing."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=NAME, prompt="Hello there", max_tokens=8191)
    message = caught.value.body["message"]
    assert "max_tokens is 8191" in message and "of the context's 8192" in message, message
    assert caught.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                       max_completion_tokens=8192)  # fmt: skip
    reply = client.completions.create(
        model=NAME, prompt="Hello", max_tokens=3, temperature=0,
        extra_body={"top_logprobs": 0, "use_beam_search": False, "stop_token_ids": []},
    )  # fmt: skip
    assert reply.choices[0].text and reply.usage.completion_tokens == 3


def test_stop_token_ids_end_a_request_at_that_token(client, llm):
    """The token is kept in the ids (and counted), not in the text; as the API gives it."""
    prompt = "Once upon a time"
    greedy = llm.generate(prompt, _greedy(12))[0].token_ids
    at = next(i for i in range(2, len(greedy)) if greedy[i] not in greedy[:i])
    params = SamplingParams(max_new_tokens=12, stop_token_ids=[greedy[at]])
    stopped = llm.generate(prompt, params)[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == greedy[: at + 1]
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"stop_token_ids": [greedy[at]]})  # fmt: skip
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].text == stopped.text
    assert reply.usage.completion_tokens == at + 1


def test_penalties_and_min_tokens_as_the_engine_runs_them(client, llm):
    """Penalties and min_tokens reach the engine: the server's greedy text is the engine's
    under the same parameters, and differs from the plain greedy text."""
    prompt = "Once upon a time"
    asked = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.3,
             "min_tokens": 10}  # fmt: skip
    ours = llm.generate(prompt, SamplingParams(max_new_tokens=12, **asked))[0]
    assert ours.text != llm.generate(prompt, _greedy(12))[0].text
    reply = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        extra_body={"repetition_penalty": 1.3, "min_tokens": 10},
    )
    assert reply.choices[0].text == ours.text and reply.usage.completion_tokens >= 10


def test_logprobs_of_completions_and_chat_as_the_engine_gives_them(client, llm):
    """A completion's logprobs (OpenAI's parallel lists) and a chat's (its content list),
    streamed as whole, are the engine's log probabilities of the same greedy tokens."""
    prompt = "Once upon a time"
    ours = llm.generate(prompt, SamplingParams(max_new_tokens=6, logprobs=2))[0]
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0,
                                      logprobs=2)  # fmt: skip
    shown = reply.choices[0].logprobs
    assert len(shown.tokens) == reply.usage.completion_tokens == len(ours.token_ids)
    assert shown.token_logprobs == pytest.approx([lp.logprob for lp in ours.logprobs], abs=1e-4)
    assert all(len(top) == 2 and max(top.values()) >= lp for top, lp in
               zip(shown.top_logprobs, shown.token_logprobs, strict=True))  # fmt: skip
    assert "".join(shown.tokens) == reply.choices[0].text
    assert shown.text_offset[0] == 0 and shown.text_offset[-1] == len(
        "".join(shown.tokens[:-1]))  # fmt: skip
    messages = [{"role": "user", "content": "Tell me a story."}]
    asked = {"model": NAME, "messages": messages, "max_tokens": 5, "temperature": 0,
             "logprobs": True, "top_logprobs": 3}  # fmt: skip
    whole = client.chat.completions.create(**asked)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens and all(
        len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob for c in content
    )
    stream = client.chat.completions.create(**asked, stream=True)
    streamed = [c for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]  # fmt: skip
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [
        (c.token, round(c.logprob, 4)) for c in content
    ]
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_echo_gives_the_prompt_tokens_log_probabilities_as_harnesses_ask(client, llm):
    """echo with max_tokens 0 and logprobs (a log-likelihood request): the prompt back, its
    tokens' log probabilities (null for the first) as the engine's, no generated token; with
    max_tokens 3 the three follow."""
    prompt = "The capital of France is Paris"
    ids = llm.engine.encode(prompt)
    ours = llm.engine.run(ids, SamplingParams(max_new_tokens=1, prompt_logprobs=1))
    reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True,
                                      logprobs=1, temperature=0)  # fmt: skip
    choice = reply.choices[0]
    assert choice.text == prompt and reply.usage.completion_tokens == 0
    shown = choice.logprobs
    assert len(shown.tokens) == len(ids) and shown.token_logprobs[0] is None
    assert shown.top_logprobs[0] is None and all(len(t) == 1 for t in shown.top_logprobs[1:])
    assert shown.token_logprobs[1:] == pytest.approx(
        [lp.logprob for lp in ours.prompt_logprobs[1:]], abs=1e-4)  # fmt: skip
    more = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, echo=True,
                                     logprobs=0, temperature=0)  # fmt: skip
    assert more.choices[0].text.startswith(prompt) and more.usage.completion_tokens == 3
    assert len(more.choices[0].logprobs.tokens) == len(ids) + 3
    three = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True,
                                      logprobs=1, n=3, temperature=0)  # fmt: skip
    assert len(three.choices) == 3  # the prompt scored once (the first), given to each
    for choice in three.choices:
        assert choice.logprobs.token_logprobs == shown.token_logprobs
    for bad in ({"max_tokens": 0}, {"echo": True, "stream": True}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=NAME, prompt=prompt, **bad)


def test_n_seeded_choices_differ_and_repeat_streamed_or_not(client):
    ask = {"model": NAME, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 1.0,
           "seed": 7, "n": 3, "extra_body": NO_EOS}  # fmt: skip

    def texts(reply) -> list[str]:
        assert sorted(c.index for c in reply.choices) == [0, 1, 2]
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    first = client.completions.create(**ask)
    assert len(set(texts(first))) == 3 and first.usage.completion_tokens == 30
    assert texts(client.completions.create(**ask)) == texts(first)
    pieces = ["", "", ""]
    for chunk in client.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            pieces[choice.index] += choice.text
    assert pieces == texts(first)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                          n=2, max_tokens=4, temperature=1.0, seed=3)  # fmt: skip
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert all(c.message.role == "assistant" for c in chat.choices)


def test_a_wrong_key_gets_401_and_the_open_routes_stay_open(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.models.list()
    assert caught.value.status_code == 401
    assert httpx.post(server.url + "/v1/completions", json={}).status_code == 401  # no key
    for header, status in (
        (f"bearer {KEY}", 200),
        (f"BEARER  {KEY}", 200),
        (f"Basic {KEY}", 401),
        (f"Bearer {KEY}x", 401),
        (KEY, 401),
    ):
        reply = httpx.get(server.url + "/v1/models", headers={"Authorization": header})
        assert reply.status_code == status, header  # the scheme in any case (RFC 9110)
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.head(server.url + "/health").status_code == 200  # (a load balancer's probe)
    assert server.metrics()['headspace_request_errors_total{status="401"}'] >= 2  # counted
    assert server.healthy()


def test_past_the_queue_bound_a_request_gets_429(client, server):
    """Fill the bound with long streams, then one more: 429; once they are closed, as many
    are accepted again (no place is lost)."""
    bound = RUNNING + QUEUED
    streams = [client.completions.create(model=NAME, prompt=f"Flood {i}", max_tokens=3000,
                                         stream=True, extra_body=NO_EOS)
               for i in range(bound)]  # fmt: skip

    def held() -> float:
        m = server.metrics()
        return m["headspace_requests_running"] + m["headspace_requests_waiting"]

    assert _wait_until(lambda: held() == bound)
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model=NAME, prompt="One more", max_tokens=2)
    assert caught.value.status_code == 429 and caught.value.body["type"] == "rate_limit_error"
    for stream in streams:
        stream.close()
    assert _wait_until(lambda: _idle(server))
    with ThreadPoolExecutor(bound) as pool:
        replies = list(pool.map(lambda i: client.completions.create(
            model=NAME, prompt=f"Again {i}", max_tokens=2), range(bound)))  # fmt: skip
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in replies)
    assert server.healthy()


def test_a_tiny_temperature_is_greedy_and_the_chat_is_checked(client, server, llm):
    reply = client.completions.create(model=NAME, prompt="The sea", max_tokens=6,
                                      temperature=1e-40)  # fmt: skip
    assert reply.choices[0].text == llm.generate("The sea", _greedy(6))[0].text
    for messages in (
        [{"role": "wizard", "content": "hi"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        [],
    ):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
    assert server.healthy()


def test_a_bounded_load_loses_nothing(client, server):
    """104 requests (arrivals spread over 12 s) from 8 clients, one in 20 cancelled after its
    first piece: every other one completes, the counters account for all, pages go back."""
    before = server.metrics()
    clients, per_client, span_s = 8, 13, 12.0
    cancels = sum(1 for n in range(clients * per_client) if n % 20 == 7)
    outcomes: list[str] = []
    failures: list[BaseException] = []
    lock = threading.Lock()

    def run(index: int) -> None:
        try:
            send(index)
        except BaseException as error:  # shown by the assertion below
            failures.append(error)

    def send(index: int) -> None:
        rng, started = random.Random(index), time.monotonic()
        for i in range(per_client):
            time.sleep(max(0.0, started + (i + rng.random()) * span_s / per_client
                           - time.monotonic()))  # fmt: skip
            prompt, tokens = " ".join(DOCUMENT.split()[: rng.randint(3, 60)]), rng.randint(2, 6)
            if (index * per_client + i) % 20 == 7:  # a cancellation
                stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=400,
                                                   stream=True, extra_body=NO_EOS)  # fmt: skip
                next(iter(stream))
                stream.close()
                outcome = "cancelled"
            else:
                reply = client.completions.create(model=NAME, prompt=prompt, max_tokens=tokens)
                outcome = reply.choices[0].finish_reason
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 600
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not failures, failures[:3]
    assert len(outcomes) == clients * per_client
    assert outcomes.count("cancelled") == cancels
    assert set(outcomes) <= {"stop", "length", "cancelled"}
    assert _wait_until(lambda: _idle(server))
    after = server.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    finished = {r: delta(f'headspace_requests_finished_total{{reason="{r}"}}')
                for r in ("stop", "length", "abort")}  # fmt: skip
    assert finished["abort"] == cancels and sum(finished.values()) == clients * per_client
    assert delta("headspace_time_to_first_token_seconds_count") == clients * per_client
    assert delta("headspace_generation_tokens_total") > clients * per_client


@pytest.mark.parametrize("flags", [["--port", "70000"], ["--max-concurrent-requests", "0"],
                                   ["--max-body-size", "0.5"], ["--api-key", ""],
                                   ["--api-key", "  "]])  # fmt: skip
def test_bad_serve_flags_get_one_line_and_exit_2(flags, capsys):
    from headspace.cli.main import main

    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_an_empty_key_in_the_environment_is_refused(monkeypatch, capsys):
    from headspace.cli.main import main

    monkeypatch.setenv("HEADSPACE_API_KEY", "")
    assert main(["serve"]) == 2
    assert capsys.readouterr().err.startswith("error: the API key is empty")


@pytest.mark.parametrize("host, warned", [("0.0.0.0", True), ("::", True), ("10.1.2.3", True),
                                          ("example.org", True), ("127.0.0.1", False),
                                          ("::1", False), ("localhost", False)])  # fmt: skip
def test_listening_beyond_loopback_without_a_key_warns(host, warned, monkeypatch, capsys):
    """The warning comes before the model loads (a bad body size stops it right after)."""
    from headspace.cli.main import main

    monkeypatch.delenv("HEADSPACE_API_KEY", raising=False)
    assert main(["serve", "--host", host, "--max-body-size", "0.5"]) == 2
    err = capsys.readouterr().err
    assert ("without an API key" in err) == warned, err
    assert main(["serve", "--host", host, "--api-key", "k", "--max-body-size", "0.5"]) == 2
    assert "without an API key" not in capsys.readouterr().err


def test_under_torchrun_rank_0_serves_and_the_others_follow(llm):
    """Two gloo ranks split the heads: concurrent completions equal the single process's,
    a stream closed early is aborted on every rank, and the server stops cleanly."""
    server = ServerProcess("--served-model-name", NAME, ranks=2)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                               timeout=300)  # fmt: skip
        prompts = ["The lighthouse keeper", "Once upon a time, in a harbour town"]

        assert _ask_together(client, prompts, 10) == [llm.generate(p, _greedy(10))[0].text
                                                      for p in prompts]  # fmt: skip
        stream = client.completions.create(model=NAME, prompt="Count:", max_tokens=500,
                                           stream=True, extra_body=NO_EOS)  # fmt: skip
        next(iter(stream))
        stream.close()
        assert _wait_until(lambda: _aborted(server) == 1)
        assert _wait_until(lambda: _idle(server))
        assert _ask_together(client, ["Still"], 10) == [llm.generate("Still", _greedy(10))[0].text]
    finally:
        output = server.stop()
    assert server.process.returncode == 0 and "Traceback" not in output, output[-3000:]

"""Connections that send their headers a byte at a time (slowloris) are closed once past
``--header-timeout``; a slow body is not, nor are other clients held up. Tried over raw
sockets against ``headspace serve`` as a process on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import time

import openai

from server_process import ServerProcess

NAME, DEADLINE_S = "smol", 1.0
BODY = json.dumps({"model": NAME, "prompt": "Hello", "max_tokens": 2}).encode()
HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY))  # fmt: skip


def _closed_after(sock: socket.socket, started: float) -> float:
    """Seconds from ``started`` (``time.monotonic``) until the server closes ``sock``
    (reads nothing more from it)."""
    sock.settimeout(30)
    assert sock.recv(1024) == b""
    return time.monotonic() - started


def _response(sock: socket.socket) -> bytes:
    """One whole response (headers and a Content-Length body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))  # fmt: skip
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_late_headers_close_the_connection_and_a_slow_body_is_served():
    server = ServerProcess("--served-model-name", NAME, "--header-timeout", str(DEADLINE_S))
    try:
        connected = time.monotonic()  # (the deadline counts from the connection)
        slow = socket.create_connection(("127.0.0.1", server.port))
        slow.sendall(HEAD[:30])  # the request line and part of a header, then nothing
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        assert client.completions.create(model=NAME, prompt="Hi", max_tokens=2).choices[0].text
        assert DEADLINE_S * 0.9 < _closed_after(slow, connected) < DEADLINE_S + 5

        kept = socket.create_connection(("127.0.0.1", server.port))
        kept.sendall(HEAD)  # the headers in time; the body well after the deadline
        time.sleep(DEADLINE_S * 2)
        kept.sendall(BODY)
        assert _response(kept).startswith(b"HTTP/1.1 200")
        late = time.monotonic()
        kept.sendall(HEAD[:30])  # the next request on the kept-alive connection: late too
        assert _closed_after(kept, late) < DEADLINE_S + 5
        assert server.healthy()
    finally:
        output = server.stop()
    assert "Traceback" not in output, output

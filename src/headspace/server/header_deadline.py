"""uvicorn's HTTP/1.1 protocol (h11) with a deadline for each request's headers.

uvicorn closes a kept-alive connection that stays idle, but not one that sends its request
line and headers a byte at a time: a few hundred such sockets hold the server's connections
for good (slowloris). Here a connection whose request headers are not whole within the
deadline, counted from when it connected or from its previous response, is closed. The
body and the response have no deadline (a long prompt may take a while to send; a stream
runs for as long as it generates).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderDeadlineProtocol(H11Protocol):
    """:class:`H11Protocol` closing a connection whose request headers are late; the
    deadline is ``header_timeout_s`` seconds (see :func:`with_header_timeout`)."""

    header_timeout_s = 10.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a request's headers came whole
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm()  # the next request's headers (a kept-alive connection)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class for uvicorn's ``Config(http=...)`` with that deadline."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout_s": seconds})


__all__ = ["HeaderDeadlineProtocol", "with_header_timeout"]

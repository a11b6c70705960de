"""What every request passes before a route: the bearer key and the body size bound.

A plain ASGI middleware (no task or stream per request, so server-sent events pass through
untouched). The body is counted as it is received, so a chunked body without a
Content-Length is bounded too.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from headspace.server.protocol import APIError


class Guard:
    """``api_key`` (None: open) on the ``/v1`` routes; at most ``max_body_bytes`` of body;
    ``refused(status)`` is told of each request it answers itself."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int,
                 refused: Callable[[int], None] = lambda status: None):  # fmt: skip
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.refused = refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope["path"], dict(scope["headers"]))
        if refusal is not None:
            self.refused(refusal.status)
            return await JSONResponse(refusal.body(), refusal.status)(scope, receive, send)
        received, most = 0, self.max_body_bytes

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > most:  # the route's handler answers 413 (an HTTPException)
                    raise HTTPException(413, f"the request body is larger than the {most} "
                                        "bytes allowed (--max-body-size)")  # fmt: skip
            return message

        await self.app(scope, counted, send)

    def _refusal(self, path: str, headers: dict[bytes, bytes]) -> APIError | None:
        """``headers``: raw names and values (bytes, as the client sent them)."""
        key = self.api_key
        if key is not None and path.startswith("/v1"):
            scheme, _, given = headers.get(b"authorization", b"").strip().partition(b" ")
            token_ok = secrets.compare_digest(given.strip(), key.encode())
            if scheme.lower() != b"bearer" or not token_ok:  # (the scheme: any case, RFC 9110)
                return APIError(401, "a valid API key is needed (Authorization: Bearer)",
                                "authentication_error")  # fmt: skip
        length = headers.get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return APIError(413, f"the request body has {length} bytes, more than the "
                            f"{self.max_body_bytes} allowed (--max-body-size)")  # fmt: skip
        return None

"""Where the engine's thread leaves one request's outputs for the asyncio task that serves
it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque

from headspace.engine.outputs import RequestOutput
from headspace.server.protocol import APIError


class Outbox:
    """What the engine thread hands one request's task: control items (None: accepted; an
    APIError) and outputs, consecutive outputs merged into one (the latest, with every new
    token, piece of text and log probability since the task last looked), so a slow reader
    holds one output, not one a step. The task is woken only when the box was empty."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.ready = loop, asyncio.Event()
        self._items: deque = deque()
        self._lock = threading.Lock()

    def put(self, item: RequestOutput | APIError | None) -> None:
        """From the engine thread."""
        with self._lock:
            last = self._items[-1] if self._items else None
            if isinstance(item, RequestOutput) and isinstance(last, RequestOutput):
                item.new_text = last.new_text + item.new_text
                item.new_token_ids = last.new_token_ids + item.new_token_ids
                if item.new_logprobs is not None:
                    item.new_logprobs = (last.new_logprobs or []) + item.new_logprobs
                self._items[-1] = item
                return
            self._items.append(item)
            if len(self._items) > 1:  # already woken
                return
        if not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the event loop closed meanwhile
                self.loop.call_soon_threadsafe(self.ready.set)

    async def take(self) -> list:
        """On the event loop: every item put since the last call, in order (waits for one)."""
        while True:
            await self.ready.wait()
            self.ready.clear()
            with self._lock:
                items, self._items = list(self._items), deque()
            if items:
                return items


__all__ = ["Outbox"]

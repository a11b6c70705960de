"""Seconds the process spends compiling: torch.compile's frames (Dynamo and Inductor) and
Triton's own kernels (the decode attention, the page copies), by the hooks each offers.

A shape met for the first time compiles while a request waits (a new block-table width
compiled the decode kernel again in the middle of a served stream: bench/NOTES.md). The
engine reads :data:`COMPILE_METER` so that what compiled outside the warm-up is told apart
from the work: ``generate``'s summary says how much, a server counts it in /metrics.
Triton's count includes kernels read back from its disk cache (milliseconds each).
"""

from __future__ import annotations

import threading
import time


class CompileMeter:
    """Seconds spent compiling since the process started (once :meth:`install` ran); the
    time of a compile that runs in another compile (Triton's inside torch.compile's) is
    counted once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._seconds = 0.0
        self._count = 0
        self._started: dict[int, tuple[float, int]] = {}  # thread -> (start, depth)
        self._installed = False

    @property
    def seconds(self) -> float:
        """Seconds of compiling so far; a compile in progress counts up to now."""
        now = time.perf_counter()
        with self._lock:
            running = sum(now - start for start, _ in self._started.values())
            return self._seconds + running

    @property
    def count(self) -> int:
        """Compiles finished so far (frames and kernels; nested ones counted once)."""
        with self._lock:
            return self._count

    def start(self) -> None:
        """A compile begins on this thread."""
        thread = threading.get_ident()
        with self._lock:
            start, depth = self._started.get(thread, (time.perf_counter(), 0))
            self._started[thread] = (start, depth + 1)

    def end(self) -> None:
        """The compile this thread began last has ended."""
        thread = threading.get_ident()
        with self._lock:
            if thread not in self._started:  # (installed while one was running)
                return
            start, depth = self._started.pop(thread)
            if depth > 1:
                self._started[thread] = (start, depth - 1)
                return
            self._seconds += time.perf_counter() - start
            self._count += 1

    def install(self) -> None:
        """Hook into torch.compile's compile callbacks and Triton's JIT hooks (once a
        process; hooks already set are kept and called first)."""
        with self._lock:
            if self._installed:
                return
            self._installed = True
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(lambda *_: self.start())
        callback_handler.register_end_callback(lambda *_: self.end())
        try:
            from triton import knobs
        except ImportError:  # (no Triton: torch.compile's frames alone)
            return
        runtime = knobs.runtime
        runtime.jit_cache_hook = _before(runtime.jit_cache_hook, self.start)
        runtime.jit_post_compile_hook = _after(runtime.jit_post_compile_hook, self.end)


def _before(hook, start):
    """Triton's hook before a compile: ``hook`` (when set), then ``start()`` unless ``hook``
    skips the compile (returns True)."""

    def call(*args, **kwargs):
        skip = hook(*args, **kwargs) if hook is not None else None
        if not skip:
            start()
        return skip

    return call


def _after(hook, end):
    """Triton's hook after a compile: ``end()``, then ``hook`` (when set)."""

    def call(*args, **kwargs):
        end()
        return hook(*args, **kwargs) if hook is not None else None

    return call


COMPILE_METER = CompileMeter()  # the process's

__all__ = ["COMPILE_METER", "CompileMeter"]

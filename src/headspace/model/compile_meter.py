"""Seconds the process spends compiling: torch.compile's frames (Dynamo and Inductor) and
Triton's own kernels (the decode attention, the page copies), by the hooks each offers;
and, told by the engine (:meth:`CompileMeter.timing`, :meth:`CompileMeter.first_use`) and
heard by the listener alone (not counted), the other work a shape costs the first time it
is met: cuDNN's execution plan of an attention shape, the capture of a decode step's CUDA
graph.

A shape met for the first time compiles while a request waits (a new block-table width
compiled the decode kernel again in the middle of a served stream: bench/NOTES.md). The
engine reads :data:`COMPILE_METER` so that what compiled outside the warm-up is told apart
from the work: ``generate``'s summary says how much, a server counts it in /metrics.
Triton's count includes kernels read back from its disk cache (milliseconds each).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

# a listener of finished compiles: (what compiled, seconds)
CompileListener = Callable[[str, float], None]


class CompileMeter:
    """Seconds spent compiling since the process started (once :meth:`install` ran); the
    time of a compile that runs in another compile (Triton's inside torch.compile's) is
    counted once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._seconds = 0.0
        self._count = 0
        self._started: dict[int, tuple[float, int, str]] = {}  # thread -> (start, depth, what)
        self._installed = False
        self._listener: CompileListener | None = None
        self._dynamo: tuple = ()  # the callbacks given to torch.compile's handler
        self._triton: tuple | None = None  # Triton's hooks before, and this meter's
        self._met: set = set()  # the keys first_use has met

    @property
    def seconds(self) -> float:
        """Seconds of compiling so far; a compile in progress counts up to now."""
        now = time.perf_counter()
        with self._lock:
            running = sum(now - start for start, _, _ in self._started.values())
            return self._seconds + running

    @property
    def count(self) -> int:
        """Compiles finished so far (frames and kernels; nested ones counted once)."""
        with self._lock:
            return self._count

    @property
    def installed(self) -> bool:
        """Whether the hooks are in (where the engine compiles: a GPU)."""
        return self._installed

    @property
    def listening(self) -> bool:
        """Whether a listener is set (:meth:`listen`)."""
        return self._listener is not None

    def listen(self, listener: CompileListener | None) -> None:
        """Call ``listener(what, seconds)`` as each compile ends (an outer one only, on the
        thread that compiled), from now on; None: no more. A server sets one once it is
        ready, so that a compile while users wait is logged with its name."""
        self._listener = listener

    def start(self, what: str = "a compile") -> None:
        """A compile of ``what`` begins on this thread."""
        thread = threading.get_ident()
        with self._lock:
            start, depth, outer = self._started.get(thread, (time.perf_counter(), 0, what))
            self._started[thread] = (start, depth + 1, outer)

    def end(self) -> None:
        """The compile this thread began last has ended."""
        thread = threading.get_ident()
        with self._lock:
            if thread not in self._started:  # (installed while one was running)
                return
            start, depth, what = self._started.pop(thread)
            if depth > 1:
                self._started[thread] = (start, depth - 1, what)
                return
            seconds = time.perf_counter() - start
            self._seconds += seconds
            self._count += 1
        self._tell(what, seconds)

    def _tell(self, what: str, seconds: float) -> None:
        """The listener, if any, hears ``what`` took ``seconds`` (inside torch.compile's
        callback too: an error of the listener's must not reach the compiler)."""
        listener = self._listener
        if listener is not None:
            try:
                listener(what, seconds)
            except Exception:
                logging.getLogger(__name__).debug("a compile listener failed", exc_info=True)

    @contextlib.contextmanager
    def timing(self, what: str):
        """Tell the listener (:meth:`listen`) of the block as ``what`` with its seconds, not
        counted as a compile: first-use work that the hooks do not see and that is not a
        compile of torch's or Triton's (a CUDA graph's capture); a compile inside it is
        timed and heard on its own."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._tell(what, time.perf_counter() - start)

    def first_use(self, key, what: Callable[[], str]):
        """:meth:`timing` of ``what()`` (called only then) if ``key`` (hashable) is met for
        the first time in this process, else nothing: a cuDNN attention plan (host work a
        shape costs once)."""
        with self._lock:
            new = key not in self._met
            self._met.add(key)
        return self.timing(what()) if new else contextlib.nullcontext()

    def has_met(self, key) -> bool:
        """Whether :meth:`first_use` has met ``key`` in this process."""
        with self._lock:
            return key in self._met

    def install(self) -> None:
        """Hook into torch.compile's compile callbacks and Triton's JIT hooks (once a
        process; hooks already set are kept and called first)."""
        with self._lock:
            if self._installed:
                return
            self._installed = True
        from torch._dynamo.callback import callback_handler

        self._dynamo = (lambda args: self.start(_frame_name(args)), lambda *_: self.end())
        callback_handler.register_start_callback(self._dynamo[0])
        callback_handler.register_end_callback(self._dynamo[1])
        try:
            from triton import knobs
        except ImportError:  # (no Triton: torch.compile's frames alone)
            return
        runtime = knobs.runtime
        before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook
        runtime.jit_cache_hook = _before(before, self.start)
        runtime.jit_post_compile_hook = _after(after, self.end)
        self._triton = (before, after, runtime.jit_cache_hook, runtime.jit_post_compile_hook)

    def uninstall(self) -> None:
        """Take the hooks out again (tests: a meter of their own leaves the process's
        compiles alone); Triton's are put back only where they are still this meter's."""
        with self._lock:
            if not self._installed:
                return
            self._installed = False
        from torch._dynamo.callback import callback_handler

        callback_handler.remove_start_callback(self._dynamo[0])
        callback_handler.remove_end_callback(self._dynamo[1])
        if self._triton is not None:
            from triton import knobs

            before, after, ours_before, ours_after = self._triton
            if knobs.runtime.jit_cache_hook is ours_before:
                knobs.runtime.jit_cache_hook = before
            if knobs.runtime.jit_post_compile_hook is ours_after:
                knobs.runtime.jit_post_compile_hook = after
            self._triton = None


def _frame_name(args) -> str:
    """What a torch.compile start callback names: what set it off (Dynamo, a CUDA graph's
    recording, ...) and its compile id ("frame/attempt"; ``TORCH_LOGS=recompiles`` gives
    the function and the guard that failed)."""
    trigger = getattr(getattr(args, "callback_trigger", None), "name", "compile").lower()
    return f"torch.compile {trigger} {getattr(args, 'compile_id', '?')}"


def _kernel_name(kwargs: dict) -> str:
    """A Triton kernel's name with its specialisation (Triton's ``repr``: the kernel, its
    launch options and each argument's type), at most 300 characters."""
    what = kwargs.get("repr") or getattr(kwargs.get("fn"), "name", None) or "a Triton kernel"
    return f"Triton {what}"[:300]


def _before(hook, start):
    """Triton's hook before a compile: ``hook`` (when set), then ``start(its name)`` unless
    ``hook`` skips the compile (returns True)."""

    def call(*args, **kwargs):
        skip = hook(*args, **kwargs) if hook is not None else None
        if not skip:
            start(_kernel_name(kwargs))
        return skip

    return call


def _after(hook, end):
    """Triton's hook after a compile: ``end()``, then ``hook`` (when set)."""

    def call(*args, **kwargs):
        end()
        return hook(*args, **kwargs) if hook is not None else None

    return call


COMPILE_METER = CompileMeter()  # the process's


def log_compiles(logger: logging.Logger, meter: CompileMeter = COMPILE_METER) -> None:
    """From now on (a server once ready), each compile that ``meter`` times is a warning in
    ``logger`` with what compiled and its seconds: a compile while users wait, named, for a
    shape the warm-up did not meet (a cuDNN plan and a graph's capture are said the same
    way, though not counted; nothing compiles on the CPU, so nothing is said there).
    The guard that failed, for a torch.compile frame, is torch's own log
    (``TORCH_LOGS=recompiles``)."""
    meter.listen(lambda what, seconds: logger.warning("compiled while serving: %s (%.2f s)",
                                                      what, seconds))  # fmt: skip


__all__ = ["COMPILE_METER", "CompileMeter", "log_compiles"]

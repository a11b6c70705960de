"""The engine's step loop beside the HTTP event loop.

One thread owns the :class:`Engine`: it takes new requests and aborts between steps, steps
while anything runs, and hands each request's outputs to the asyncio task that waits for
them (``loop.call_soon_threadsafe``). Requests past ``max_concurrent`` wait in the loop's
queue, up to ``max_queued`` more; past that, ``submit`` answers 429 at once. The loop also
keeps the metrics (requests, tokens, time to first token, time per output token, the head
map and the pages in use), updated after every step.

Under torchrun every rank runs an engine loop: rank 0's takes requests from HTTP and, each
turn, broadcasts what it took (new requests, aborts, stop) to the others, whose loops
(``follow``) apply the same commands in the same order and step alike.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from headspace.engine.engine import Engine
from headspace.engine.outputs import RequestOutput
from headspace.engine.sampling import SamplingParams
from headspace.engine.warm_shapes import WARM_UP_PIECE
from headspace.errors import UserError
from headspace.model.compile_meter import COMPILE_METER, CompileMeter, log_compiles
from headspace.parallel.dist import broadcast_object, first_error
from headspace.parallel.launch import is_first_rank
from headspace.server.metrics import Metrics
from headspace.server.outbox import Outbox
from headspace.server.protocol import (
    API_FIELDS,
    APIError,
    ended_alone,
    engine_stopped,
    shutting_down,
)

log = logging.getLogger("headspace.serve")
IDLE_WAIT_S = 0.5  # how long the idle loop waits for a request before looking again
OBSERVE_EVERY_S = 0.25  # the load gauges' refresh while requests run


def freeze_heap() -> None:
    """Collect, then take every object the process holds now (modules, the model, compiled
    graphs, the warm-up's leftovers) out of the garbage collector's view, as a long-lived
    server should: a full collection would otherwise walk them all between two steps and
    stall every stream (78 ms over 188K objects after a warm-up with the embedded model on
    a CPU; 223-316 ms over 400-480K in a process that decoded Llama-3.1-8B's shape on an
    H200; none once frozen). A frozen object is never collected once in a reference cycle:
    moves between layouts free what they drop by reference counts (tests/test_stepping.py)."""
    gc.collect()
    gc.freeze()


@dataclass(eq=False)  # found by identity (a prompt may be long, and repeated)
class _Submitted:
    """A request on its way into the engine, and where its outputs go."""

    prompt_ids: list[int]
    params: SamplingParams
    outbox: Outbox | None  # None on the ranks that follow rank 0
    key: int = 0  # the same on every rank
    arrived: float = field(default_factory=time.perf_counter)
    engine_id: int | None = None  # once the engine has it
    last_token_at: float = 0.0
    aborted: bool = False

    def deliver(self, item: RequestOutput | APIError | None) -> None:
        if self.outbox is not None:  # (a following rank's requests have none)
            self.outbox.put(item)


class EngineLoop:
    """Runs ``engine`` on its own thread; ``submit`` / ``abort`` from the event loop."""

    def __init__(self, engine: Engine, metrics: Metrics, max_concurrent: int, max_queued: int,
                 compile_meter: CompileMeter = COMPILE_METER):  # fmt: skip
        self.engine, self.metrics, self.compile_meter = engine, metrics, compile_meter
        self.max_concurrent, self.max_queued = max_concurrent, max_queued
        self._inbox: queue.Queue = queue.Queue()  # ("add" | "abort" | "stop", _Submitted)
        self._queued: deque[_Submitted] = deque()  # checked, waiting for a place
        self._by_key: dict[int, _Submitted] = {}  # requests not ended, by key
        self._next_key = 0
        self._ranked = engine.ranks is not None  # commands go to every rank
        self._running: dict[int, _Submitted] = {}  # engine id -> request
        self._count = 0  # requests accepted and not yet ended (read by the event loop)
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self.ready = threading.Event()  # warm-up done
        self.error: BaseException | None = None  # what stopped the loop, if anything
        self.on_stopped = lambda: None  # called on the engine's thread once an error stopped it
        self.draining = False  # shutting down: new requests are refused (the event loop's)
        self._observed = 0.0  # when the load gauges were last set (perf_counter seconds)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # -- the event loop's side -----------------------------------------------------------
    def start(self, warm_up: bool = True) -> None:
        self._warm_up = warm_up
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop (under torchrun, every rank's) and wait for it; again: nothing."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._inbox.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def follow(self, warm_up: bool = True) -> None:
        """Under torchrun, on every rank but 0: apply rank 0's commands and step alike,
        until rank 0 stops."""
        assert self._ranked and not is_first_rank()
        for signum in (signal.SIGINT, signal.SIGTERM):  # rank 0's "stop" ends this rank
            signal.signal(signum, signal.SIG_IGN)
        self._warm_up = warm_up
        self._run()

    def reserve(self, count: int = 1) -> None:
        """Take ``count`` places for new requests (before any work on them; all or none),
        or raise APIError: 503 when the engine has stopped, 429 past the bound. Each
        ``generate`` or a ``release`` gives one back."""
        if self.error is not None or not self._thread.is_alive():
            raise engine_stopped()
        if self.draining:
            raise shutting_down(ended=False)
        with self._count_lock:
            if self._count + count > self.bound:
                raise APIError(429, f"the server holds {self._count} requests, its bound "
                               f"({self.max_concurrent} running + {self.max_queued} queued); "
                               "try again later", "rate_limit_error")  # fmt: skip
            self._count += count

    @property
    def bound(self) -> int:
        """Requests held at most: running and queued."""
        return self.max_concurrent + self.max_queued

    @property
    def held(self) -> int:
        """Requests accepted (or with a place reserved) and not yet ended."""
        with self._count_lock:
            return self._count

    def end_all(self) -> None:
        """End every request held now with a 503 (a stream: an error event, then
        ``[DONE]``), aborted in the engine between two steps (shutting down)."""
        self._inbox.put(("end_all", None))

    def release(self, count: int = 1) -> None:
        """Give back ``count`` places taken by ``reserve`` for requests not generated."""
        with self._count_lock:
            self._count -= count

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       arrived: float) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """For a request whose place is reserved (``arrived``: when it reached the server,
        perf_counter seconds): None once the engine has accepted it, then its outputs as
        its steps come; the last is finished. Raises APIError (400 for what the engine
        refuses). Cancelling the iteration (a client gone) aborts the request and frees
        its pages."""
        request = _Submitted(prompt_ids, params, Outbox(asyncio.get_running_loop()),
                             arrived=arrived)  # fmt: skip
        self._inbox.put(("add", request))  # its key is given on the engine's thread
        if self.error is not None or not self._thread.is_alive():  # it stopped meanwhile
            raise engine_stopped()
        finished = False
        try:
            while True:
                for item in await request.outbox.take():
                    if isinstance(item, APIError):
                        finished = True
                        raise item
                    yield item
                    if item is not None and item.finished:
                        finished = True
                        return
        finally:
            if not finished:  # cancelled, or the consumer stopped early
                self._inbox.put(("abort", request))

    # -- the engine's side ---------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._warm_up:
                compiled = self.compile_meter.seconds
                seconds = self.engine.warm_up(**self._warm_up_shapes())
                log.info("warm-up %.1f s (%.1f s compiling)", seconds,
                         self.compile_meter.seconds - compiled)  # fmt: skip
            log_compiles(log, self.compile_meter)  # (from now on users wait for it: named)
            freeze_heap()
            self.ready.set()
            while True:
                commands = self._take(block=not self.engine.has_unfinished() and not self._queued)
                if self._ranked:  # rank 0's commands, on every rank
                    commands = self._broadcast(commands)
                    if commands is None:  # rank 0 has gone: nothing to serve
                        return
                if not self._apply(commands):
                    return
                self._admit()
                if self.engine.has_unfinished():
                    self._deliver(self.engine.step())
                self._observe()
        except BaseException as error:  # the server must say it, not hang its clients
            log.exception("the engine loop stopped")
            if self._ranked and not is_first_rank():  # (exits non-zero: torchrun stops all)
                raise
            self.error = error
            self._fail_all()
            self.ready.set()
            self.on_stopped()

    def _warm_up_shapes(self) -> dict:
        """What the warm-up runs: where the engine compiles (a GPU), a prompt of a full
        prefill chunk and a piece of another length, a decode batch of every bucket up to
        ``max_concurrent``, the decode graphs of every width and the cuDNN plans of every
        causal square a prompt of up to a chunk meets, and the prompt again through the
        offload lane laid out for the whole context, so that no compile stands between users
        and their tokens."""
        if not self.engine.config.runtime.on_gpu:
            return {}
        return {
            "prompt_len": self.engine.lanes.chunk + WARM_UP_PIECE,
            "batch": self.max_concurrent,
            "report": log.info,
            "offload": True,
            "shapes": True,
        }

    def _observe(self) -> None:
        """The load gauges, at most every ``OBSERVE_EVERY_S`` while requests run (counting the
        head map's tiers walks its entries) and on every idle turn."""
        now = time.perf_counter()
        if self.engine.has_unfinished() and now - self._observed < OBSERVE_EVERY_S:
            return
        self._observed = now
        self.metrics.observe_load(self.engine.load(), len(self._queued))

    def _broadcast(self, commands: list[tuple]) -> list[tuple] | None:
        """Rank 0's ``commands`` on every rank; None on a following rank when rank 0 has
        gone (the group broke)."""
        try:
            return broadcast_object(commands, host=True)
        except Exception as error:  # noqa: BLE001 (gloo raises its own kinds)
            if is_first_rank():
                raise
            log.warning("rank 0 stopped (%s); this rank stops too", error)
            return None

    def _agreed(self, error: Exception | None) -> Exception | None:
        """Under torchrun, an error on any rank is one on every rank (the lowest rank's);
        alone, ``error``."""
        if not self._ranked:
            return error
        message = first_error(None if error is None else f"{type(error).__name__}: {error}")
        if message is None or error is not None:
            return error
        return RuntimeError(f"refused on another rank: {message}")

    def _fail_all(self) -> None:
        """Every request known or on its way gets a 500 (the error is in the log, not in
        what clients read)."""
        pending = list(self._by_key.values())
        while True:
            try:
                kind, request = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                pending.append(request)
        failure = APIError(500, "the engine stopped on an internal error; the server exits",
                           "server_error")  # fmt: skip
        for request in pending:
            request.deliver(failure)

    def _take(self, block: bool) -> list[tuple]:
        """The commands in the inbox (waiting a while for one when idle), as plain data:
        ("add", key, prompt ids, params), ("abort", key), ("stop",). Rank 0 only."""
        commands = []
        if self._ranked and not is_first_rank():
            return commands
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return commands
        while True:
            kind, request = item
            if kind == "add":
                request.key, self._next_key = self._next_key, self._next_key + 1
                self._by_key[request.key] = request
                commands.append(("add", request.key, request.prompt_ids, request.params))
            else:
                commands.append((kind,) if request is None else (kind, request.key))
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return commands

    def _apply(self, commands: list[tuple]) -> bool:
        """Take in the turn's commands; False on "stop"."""
        for command in commands:
            if command[0] == "stop":
                return False
            if command[0] == "end_all":
                self._end_all()
                continue
            if command[0] == "add" and command[1] not in self._by_key:  # a following rank
                key, ids, params = command[1:]
                self._by_key[key] = _Submitted(ids, params, None, key)
            request = self._by_key.get(command[1])
            if request is not None:
                self._handle(command[0], request)
        return True

    def _handle(self, kind: str, request: _Submitted) -> None:
        if kind == "add":
            error = None
            try:
                self.engine.check_request(request.prompt_ids, request.params)
            except Exception as caught:  # noqa: BLE001 (a bad request must not stop the loop)
                error = caught
            error = self._agreed(error)
            if error is not None:
                self._refuse(request, error)
                return
            self._queued.append(request)
            request.deliver(None)  # accepted
        elif kind == "abort" and not request.aborted:
            request.aborted = True
            if request.engine_id is not None:
                self.engine.abort(request.engine_id)  # its output comes with the next step
            elif request in self._queued:
                self._queued.remove(request)
                self._end(request)
                self.metrics.aborted.inc()

    def _end_all(self) -> None:
        """Every request known ends with a 503 and is aborted (rank 0 delivers it)."""
        for request in list(self._by_key.values()):
            if not request.aborted:
                request.deliver(shutting_down(ended=True))
            self._handle("abort", request)

    def _admit(self) -> None:
        """Queued requests into the engine while fewer than ``max_concurrent`` run there."""
        while self._queued and len(self._running) < self.max_concurrent:
            request, error = self._queued.popleft(), None
            try:
                request.engine_id = self.engine.add_request(request.prompt_ids, request.params)
            except Exception as caught:  # noqa: BLE001 (checked on arrival; the engine changed)
                error = caught
            agreed = self._agreed(error)  # (a collective under torchrun: once a request)
            if agreed is not None:
                if error is None:  # refused on another rank: taken back here too
                    self.engine.abort(request.engine_id)  # (its output is not delivered)
                self._refuse(request, agreed)
                continue
            self._running[request.engine_id] = request
            self.metrics.prompt_tokens.inc(len(request.prompt_ids))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for output in outputs:
            request = self._running.get(output.request_id)
            if request is None:
                continue
            self.metrics.observe_tokens(request, output, now)
            if output.finished:
                del self._running[output.request_id]
                self._end(request)
                self.metrics.finished(output.finish_reason)
            if request.aborted:
                continue
            failed = output.finish_reason == "error"
            request.deliver(ended_alone(output.stats.ended) if failed else output)

    def _refuse(self, request: _Submitted, error: Exception) -> None:
        """End ``request`` with a 400 (what the engine refuses) or, for anything else, a 500
        for it alone (logged)."""
        self._end(request)
        if isinstance(error, UserError):
            field = API_FIELDS.get(error.param, "prompt")  # (the prompt, unless it names one)
            request.deliver(APIError(400, str(error), param=field))
            return
        log.exception("request refused by an error")
        request.deliver(APIError(500, "the request failed inside the engine (the server's "
                                 "log says why)", "server_error"))  # fmt: skip
        self.metrics.finished("error")

    def _end(self, request: _Submitted) -> None:
        self._by_key.pop(request.key, None)
        with self._count_lock:
            self._count -= 1

"""Start the server: the engine loop on its thread, the app under uvicorn on this one."""

from __future__ import annotations

import logging
import sys
import time

import uvicorn

from headspace.engine.engine import Engine
from headspace.parallel.launch import is_first_rank
from headspace.server.app import ServerOptions, build_app
from headspace.server.engine_loop import EngineLoop, log
from headspace.server.header_deadline import with_header_timeout
from headspace.server.metrics import Metrics

# The engine thread gives up the GIL at every wait (a CUDA sync, a CPU-attention job) and
# then waits for it while the HTTP thread runs, up to the switch interval (5 ms by
# default) each time, dozens of times a step. 0.5 ms: a 256K request's decode through
# the server, short ones arriving, went from 1007 to 578 ms a token (H200).
SWITCH_INTERVAL_S = 0.0005
ENDED_GRACE_S = 5.0  # after the requests still held are ended, the most the server waits


class DrainingServer(uvicorn.Server):
    """uvicorn's server, shutting down gracefully on SIGINT or SIGTERM: new requests get 503
    at once (``/health`` too), the requests held may finish for ``shutdown_timeout``
    seconds, the others then end with a 503 (a stream: an error event, then ``[DONE]``),
    and the server stops with nothing cut off; the process exits 0. A second signal stops
    it at once."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, shutdown_timeout: float):
        super().__init__(config)
        self.engine_loop, self.shutdown_timeout = engine_loop, shutdown_timeout
        self.draining_since: float | None = None  # monotonic seconds
        self._ended = False

    def handle_exit(self, sig: int, frame) -> None:  # (not re-raised at exit: exit code 0)
        if self.draining_since is not None:
            self.should_exit = self.force_exit = True
            return
        self.draining_since = time.monotonic()
        self.engine_loop.draining = True
        log.info("shutting down: %d requests may finish within %.0f s",
                 self.engine_loop.held, self.shutdown_timeout)  # fmt: skip

    async def on_tick(self, counter: int) -> bool:
        if self.draining_since is not None and not self.should_exit:
            waited = time.monotonic() - self.draining_since
            if self.engine_loop.held == 0 or self.engine_loop.error is not None:
                self.should_exit = True
            elif waited >= self.shutdown_timeout and not self._ended:
                log.info("ending the %d requests still held", self.engine_loop.held)
                self.engine_loop.end_all()
                self._ended = True
            elif waited >= self.shutdown_timeout + ENDED_GRACE_S:
                self.should_exit = True
        return await super().on_tick(counter)


def serve(engine: Engine, options: ServerOptions, host: str, port: int, *,
          max_concurrent: int = 64, max_queued: int = 256, warm_up: bool = True,
          shutdown_timeout: float = 30.0, header_timeout: float = 10.0) -> None:  # fmt: skip
    """Serve ``engine`` on ``host:port`` until interrupted; ``/health`` says ready once the
    warm-up request has run. An error that stops the engine ends the process with exit
    code 1 (its requests get a 500 first), never a server that answers 503 for good.
    On SIGINT or SIGTERM it shuts down gracefully (:class:`DrainingServer`, within
    ``shutdown_timeout`` seconds). Under torchrun rank 0 serves and the other ranks follow
    its steps (they return when it stops). A connection whose request headers are not whole
    within ``header_timeout`` seconds is closed (:mod:`headspace.server.header_deadline`)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    loop = EngineLoop(engine, Metrics(options.served_model_name), max_concurrent, max_queued)
    if engine.ranks is not None and not is_first_rank():  # rank 0 serves; this one follows
        loop.follow(warm_up)
        return
    app = build_app(loop, options)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", loop="auto",
                            timeout_graceful_shutdown=5,
                            http=with_header_timeout(header_timeout))  # fmt: skip
    server = DrainingServer(config, loop, shutdown_timeout)

    def exit_soon():  # (on the engine's thread; uvicorn looks at the flag every 0.1 s)
        server.should_exit = True

    loop.on_stopped = exit_soon
    loop.start(warm_up)
    try:
        server.run()
    finally:
        loop.stop()
    if loop.error is not None:  # a supervisor restarts a process that exits non-zero
        print("error: the engine stopped on an internal error (logged above); exiting",
              file=sys.stderr, flush=True)  # fmt: skip
        raise SystemExit(1)

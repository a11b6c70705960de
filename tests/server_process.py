"""``headspace serve`` started as users start it: a process on 127.0.0.1 and a free port."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A running server; ``url`` is its base (``http://127.0.0.1:PORT``); ``ranks``: under
    torchrun with that many ranks."""

    def __init__(self, *flags: str, ranks: int = 1, ready_within_s: float = 240,
                 program: list[str] | None = None):  # fmt: skip
        """``program``: what serves in place of ``python -m headspace.cli serve`` (given the
        port and ``flags``), e.g. a test's server with engine hooks."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        program = program or [sys.executable, "-m", "headspace.cli", "serve"]
        command = [*program, "--port", str(self.port), *flags]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if ranks > 1:  # torchrun on the CPU (gloo): rank 0 serves, the others follow
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc-per-node={ranks}", "-m", *command[2:]]  # fmt: skip
            env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (a pipe could fill)
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        text=True, env=env)  # fmt: skip
        deadline = time.monotonic() + ready_within_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.output()}")
            if self.healthy():
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError("the server was not ready in time")

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {name with labels but model_name: value}."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        values = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")
            values[name] = float(value)
        return values

    def stop(self) -> str:
        """Interrupt it (as Ctrl-C does; under torchrun, rank 0's process, which tells the
        others to stop); its output."""
        if self.process.poll() is None:
            os.kill(self._rank_zero(), signal.SIGINT)
            try:
                self.process.wait(timeout=60)  # (a graceful shutdown may take a while)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.output()

    def output(self) -> str:
        """What it has written so far (stdout and stderr)."""
        self._log.seek(0)
        return self._log.read()

    def _rank_zero(self) -> int:
        """The pid of rank 0: the server itself, or torchrun's worker with RANK=0."""
        children = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True,
                                  text=True).stdout.split()  # fmt: skip
        for pid in children:
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"RANK=0" in environ:
                return int(pid)
        return self.process.pid

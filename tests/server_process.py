"""``headspace serve`` started as users start it: a process on 127.0.0.1 and a free port."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A running server; ``url`` is its base (``http://127.0.0.1:PORT``)."""

    def __init__(self, *flags: str, ready_within_s: float = 240):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "headspace.cli", "serve", "--port", str(self.port), *flags]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env=env)  # fmt: skip
        deadline = time.monotonic() + ready_within_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: {self.process.stdout.read()}")
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
        """Interrupt it (as Ctrl-C does); its output."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.stdout.read()

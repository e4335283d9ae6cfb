"""Start ``vllm serve`` as a child process and talk to it (demo, tests,
benchmarks). Uses only the OpenAI HTTP API and ``/metrics``."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server to bind later, taken
    below the kernel's ephemeral range: a port from binding port 0 is an
    ephemeral one, which any socket bound to port 0 meanwhile may take
    (vLLM's engines bind their ZMQ sockets so; a P/D prefill's NIXL side
    channel once lost its port to the server starting beside it, and hung
    unhealthy). Drawn at random, so two callers rarely pick one port."""
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(64 if low > 2048 else 0):
        port = draw.randint(max(1024, low - 16384), low - 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that range is full: an ephemeral port after all
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def vllm_command() -> str:
    """The ``vllm`` executable next to this interpreter (the venv's)."""
    exe = Path(sys.executable).with_name("vllm")
    return str(exe) if exe.exists() else (shutil.which("vllm") or "vllm")


class PortInUse(RuntimeError):
    """A server exited at start because a port it was told to bind was taken
    (a port drawn by :func:`free_port` can be taken before the child binds it)."""


class ServerClient:
    """The OpenAI HTTP API and ``/metrics`` of a server at ``url``."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    # -- requests --------------------------------------------------------------
    def model_name(self, timeout: float = 60.0) -> str:
        with urllib.request.urlopen(self.url + "/v1/models", timeout=timeout) as r:
            return json.load(r)["data"][0]["id"]

    def post(self, path: str, body: dict, timeout: float = 600.0, headers: dict[str, str] | None = None) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)

    def stream(self, path: str, body: dict, timeout: float = 600.0) -> Iterator[dict]:
        """Yield the JSON chunks of a streamed (SSE) response (``timeout``: per read)."""
        req = urllib.request.Request(self.url + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                yield json.loads(data)

    def metrics(self, timeout: float = 60.0) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=timeout) as r:
            return r.read().decode()


START_ATTEMPTS = 3
"""Starts in all for a server (or a P/D pair) whose drawn port another process
took before the child bound it: each new start draws new ports."""

LOG_TAIL_CHARS = 3000


def start_drawing_ports_again(start: Callable[[], None], stop: Callable[[], None],
                              draw_again: Callable[[int], bool], attempts: int = START_ATTEMPTS) -> int:
    """``start()`` (start children and wait until they are healthy) until
    one start binds its ports: where it raises :class:`PortInUse`,
    ``stop()`` and, if ``draw_again(attempt)`` drew new ports (False: every
    port was the caller's, nothing to redraw), start again, ``attempts`` in
    all. Any other failure stops and raises at once: no child is left
    behind that did not come up. Returns the attempt that came up (one
    loop for a server and a P/D pair: :class:`VllmServer`,
    :class:`~vllm_loopspec.disagg.launcher.PDDeployment`)."""
    for attempt in range(1, attempts + 1):
        try:
            start()
            return attempt
        except PortInUse:
            stop()
            if attempt == attempts or not draw_again(attempt):
                raise
        except BaseException:
            stop()
            raise
    raise AssertionError("unreachable: the last attempt returns or raises")


class VllmServer(ServerClient):
    """``vllm serve CKPT ARGS`` on 127.0.0.1; a context manager."""

    def __init__(self, checkpoint: str | Path, *args: str, port: int | None = None,
                 log_path: str | Path | None = None, env: dict[str, str] | None = None) -> None:
        self.checkpoint, self.args, self.port_given = str(checkpoint), args, port is not None
        self._listen_on(port or free_port())
        self.log_path = Path(log_path) if log_path else None
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                    **(env or {})}
        self.env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        self.proc: subprocess.Popen | None = None

    def _listen_on(self, port: int) -> None:
        self.port = port
        super().__init__(f"http://127.0.0.1:{port}")
        self.cmd = [vllm_command(), "serve", self.checkpoint, "--host", "127.0.0.1", "--port", str(port),
                    *self.args]

    def __enter__(self) -> "VllmServer":
        """Start and wait; a start that lost the port drawn for it (taken
        before the child bound it) is tried again on a new one,
        ``START_ATTEMPTS`` in all."""
        def start_and_wait() -> None:
            self.start()
            self.wait_healthy()

        def draw_again(attempt: int) -> bool:
            if self.port_given:
                return False
            self._listen_on(free_port())
            return True

        self.start_attempts = start_drawing_ports_again(start_and_wait, self.stop, draw_again)
        return self

    def start(self) -> None:
        """Start the child without waiting for it (``wait_healthy`` waits)."""
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """SIGKILL the child's process group (its own session: the API server
        and its engine core), as a crash would; for fault tests."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path else ""

    def wait_healthy(self, timeout: float = 600.0) -> None:
        """Wait for ``/health``; raise with the log's tail if the child exits
        (:class:`PortInUse` where it lost a port it was given) or times out."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc and self.proc.poll() is not None:
                log = self.log_path.read_text(errors="replace") if self.log_path else ""
                port_lost = [line for line in log.splitlines() if "address already in use" in line.lower()]
                if port_lost:  # the engine core's cause, which the front end's traceback (the tail) omits
                    raise PortInUse(f"vllm serve exited with {self.proc.returncode}: {port_lost[-1].strip()}\n"
                                    f"{log[-LOG_TAIL_CHARS:]}")
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}\n{log[-LOG_TAIL_CHARS:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vllm serve not healthy after {timeout}s: {' '.join(self.cmd)}\n{self.log_tail()}")

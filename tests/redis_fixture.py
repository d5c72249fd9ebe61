"""A real `redis-server` on a free loopback port, without persistence, that a test can pause,
kill and restart on the same port. Missing redis-server fails the test: the project's own
scripts install it (`scripts/redis-server.sh`, run by `make test`)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

READY_LINE = "Ready to accept connections"
START_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        pytest.fail(
            "redis-server is not installed: run `bash scripts/redis-server.sh` (Debian: "
            "apt-get install redis-server); `make test` does this itself",
            pytrace=False,
        )
    return found


class RedisServer:
    """One redis-server process at `url`; `kill` + `start` bring it back on the same port."""

    def __init__(self, binary: str, port: int, log_path: Path) -> None:
        self.binary = binary
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self._drainer: threading.Thread | None = None

    def start(self) -> None:
        assert self.proc is None, "already running"
        proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        ready = threading.Event()
        # The log is drained for the whole life of the process: a full pipe would stall Redis.
        self._drainer = threading.Thread(target=self._drain, args=(proc, ready), daemon=True)
        self._drainer.start()
        if not ready.wait(START_TIMEOUT_S) or proc.poll() is not None:
            self.proc = proc
            self.kill()
            pytest.fail(f"redis-server did not start on port {self.port}: {self.log_path}")
        self.proc = proc

    def _drain(self, proc: subprocess.Popen[str], ready: threading.Event) -> None:
        assert proc.stdout is not None
        with proc.stdout, self.log_path.open("a") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if READY_LINE in line:
                    ready.set()
        ready.set()  # exited: start() sees poll() is not None

    def pause(self) -> None:
        """SIGSTOP: connections still open (the kernel accepts them) but nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: no shutdown, no save; connections are reset, the port refuses."""
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.send_signal(signal.SIGCONT)  # a paused process must be able to die
            proc.kill()
            proc.wait()
        drainer, self._drainer = self._drainer, None
        if drainer is not None:
            drainer.join()  # it closes the pipe on end of file


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(redis_server_binary(), free_port(), tmp_path / "redis.log")
    server.start()
    try:
        yield server
    finally:
        server.kill()

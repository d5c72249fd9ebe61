"""The refusal budget against a real `fulcrum serve`: a connection that retries its 503s at once
is held to its budget, a client that waits Retry-After is never held, another connection is
answered during the storm, holds are counted on /metrics, and SIGTERM still drains and exits
while a connection is held."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_early_refusal_edge import BODY, SLOW_ECHO, read_response

from fulcrum.demo import free_port, wait_ready

pytestmark = pytest.mark.e2e

RATE = 8.0  # the server's default refusals per second and connection
INFER = (b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n"
         % len(BODY) + BODY)  # fmt: skip
HOLDS = re.compile(r"^fulcrum_refusal_holds_total (\S+)$", re.M)


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log
        self.port = int(url.rsplit(":", 1)[1])

    def holds(self) -> float:
        found = HOLDS.search(httpx.get(f"{self.url}/metrics", timeout=10).text)
        assert found is not None, "no fulcrum_refusal_holds_total on /metrics"
        return float(found.group(1))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    (tmp_path / "models" / "slow" / "1").mkdir(parents=True)
    (tmp_path / "models" / "slow" / "config.toml").write_text(SLOW_ECHO)
    port = free_port()
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fulcrum.cli", "serve", "--repository",
             str(tmp_path / "models"), "--port", str(port), "--drain-timeout", "5"],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc, timeout_s=120)
            yield Server(proc, f"http://127.0.0.1:{port}", log)
        finally:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text()


class Busy:
    """Two clients in a loop keep the slow model's one slot and its queue (bound 1) full."""

    def __init__(self, url: str) -> None:
        self.stop = threading.Event()
        self.num_answered = 0
        self.threads = [threading.Thread(target=self._run, args=(url,)) for _ in range(2)]

    def _run(self, url: str) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop.is_set():
                try:
                    response = client.post(f"{url}/v2/models/slow/infer", content=BODY)
                except httpx.HTTPError:  # the server went away (the SIGTERM test)
                    return
                self.num_answered += response.status_code == 200
                retry_after = response.headers.get("retry-after")
                if retry_after is not None:  # polite: a busy client that stormed would be held
                    self.stop.wait(int(retry_after))

    def __enter__(self) -> Busy:
        for thread in self.threads:
            thread.start()
        time.sleep(0.5)  # both sent: one runs, one waits
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()


def storm_until_held(server: Server, sock: socket.socket) -> None:
    """Storm until the server holds connections: the burst and half the server-wide allowance
    are spent (how long that takes depends on how fast this machine refuses)."""
    holds_before = server.holds()
    for _ in range(60):
        storm(sock, 0.5)
        if server.holds() > holds_before:
            return
    raise AssertionError("no connection was ever held")


def storm(sock: socket.socket, seconds: float) -> list[int]:
    """A closed loop ignoring Retry-After: the statuses it got in `seconds`."""
    statuses = []
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        sock.sendall(INFER)
        statuses.append(int(read_response(sock).split(b" ", 2)[1]))
    return statuses


def test_a_retry_storm_is_held_to_its_budget_and_others_are_answered(server: Server) -> None:
    with Busy(server.url) as busy, socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(10)
        storm_until_held(server, sock)
        answered_before, holds_before = busy.num_answered, server.holds()
        statuses = storm(sock, 1.0)
        # while this connection is held, another is answered
        assert httpx.get(f"{server.url}/v2/health/ready", timeout=10).status_code == 200
        answered = busy.num_answered - answered_before
    refused = statuses.count(503)
    # the budget's rate, plus what each answer of the busy clients lets through (4 per answer,
    # the default --refusals-per-answer); a storm without the budget makes hundreds
    assert refused <= RATE * 1.0 + 4 * (answered + 1) + 2, (refused, answered)
    assert server.holds() > holds_before


def test_a_client_that_waits_retry_after_is_never_held(server: Server) -> None:
    with Busy(server.url), socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(10)
        holds_before = server.holds()
        for _ in range(4):
            sock.sendall(INFER)
            match = re.search(rb"\r\nretry-after: (\d+)\r\n", read_response(sock).lower())
            if match is not None:  # refused: waits as told
                time.sleep(int(match.group(1)))
        assert server.holds() == holds_before


def test_sigterm_drains_and_exits_while_a_connection_is_held(server: Server) -> None:
    with Busy(server.url), socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(10)
        storm_until_held(server, sock)
        sock.sendall(INFER)  # likely held: unread
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0

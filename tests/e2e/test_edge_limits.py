"""Limits at the edge against a real `fulcrum serve`, over raw sockets: oversized and overfull
request heads (431), clients that stall or dribble their head or body (408, then closed), and an
empty admin token on a non-loopback bind."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from fulcrum.demo import free_port, wait_ready

pytestmark = pytest.mark.e2e

ECHO = """platform = "echo"
max_batch_size = 4
inputs = [{name = "x", datatype = "FP32", shape = [4]}]
outputs = [{name = "y", datatype = "FP32", shape = [4]}]
"""
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
IO_TIMEOUT_S = 10.0  # any single socket wait; far beyond every limit the server is given
CHUNK_BYTES = 1 << 16
NUM_DRIBBLERS = 60  # half dribble their head, half their body


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A server on every address (non-loopback) with an empty admin token and short timeouts."""
    root = tmp_path_factory.mktemp("edge")
    (root / "models" / "echo" / "1").mkdir(parents=True)
    (root / "models" / "echo" / "config.toml").write_text(ECHO)
    port = free_port()
    env = {**os.environ, "FULCRUM_ADMIN_TOKEN": ""}
    with (root / "server.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fulcrum.cli", "serve", "--repository", str(root / "models"),
             "--host", "0.0.0.0", "--port", str(port),
             "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S)],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc, timeout_s=120)
            yield port
        finally:
            proc.kill()
            proc.wait()
    log_text = (root / "server.log").read_text()
    assert "Traceback" not in log_text, log_text


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S)


def send_until_refused(sock: socket.socket, data: bytes) -> int:
    """Send `data` in chunks; stop when the server has closed. Returns the bytes sent."""
    num_sent = 0
    for start in range(0, len(data), CHUNK_BYTES):
        try:
            sock.sendall(data[start : start + CHUNK_BYTES])
        except OSError:
            break
        num_sent += min(CHUNK_BYTES, len(data) - start)
    return num_sent


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes its side; fails if it never does."""
    received = b""
    deadline = time.monotonic() + IO_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            data = sock.recv(CHUNK_BYTES)
        except ConnectionResetError:
            return received
        if not data:
            return received
        received += data
    raise AssertionError(f"server kept the connection open; got {received[:200]!r}")


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response.split(b" ", 2)[1])


def live(port: int) -> int:
    return httpx.get(f"http://127.0.0.1:{port}/v2/health/live", timeout=IO_TIMEOUT_S).status_code


def test_8mb_header_line_gets_431_and_the_server_keeps_serving(port: int) -> None:
    with connect(port) as sock:
        send_until_refused(sock, b"GET /v2/health/live HTTP/1.1\r\nX-Big: " + b"b" * (8 << 20))
        response = read_to_close(sock)
    assert status_of(response) == 431
    assert response.endswith(b'{"error":"request head over 64 KiB"}')
    assert live(port) == 200


def test_10000_headers_get_431(port: int) -> None:
    fields = b"".join(b"h%d:v\r\n" % i for i in range(10_000))
    with connect(port) as sock:
        send_until_refused(sock, b"GET /v2/health/live HTTP/1.1\r\nHost: a\r\n" + fields + b"\r\n")
        response = read_to_close(sock)
    assert status_of(response) == 431
    assert response.endswith(b'{"error":"more than 100 header fields"}')
    assert live(port) == 200


def test_client_that_stalls_in_its_head_is_disconnected(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: a\r\n")  # half the head
        response = read_to_close(sock)
    assert status_of(response) == 408
    assert b"request head not received within 1 s" in response


def test_client_that_stalls_in_its_body_is_disconnected(port: int) -> None:
    head = b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n"
    with connect(port) as sock:
        sock.sendall(head + b'{"inputs": [')
        response = read_to_close(sock)
    assert status_of(response) == 408
    assert b"request body not received within 1 s" in response


def test_dribbling_clients_are_all_released(port: int) -> None:
    """One byte at a time from each, as long as the server listens: none may hold on."""
    body_head = b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: a\r\nContent-Length: 9999\r\n\r\n"
    socks = [connect(port) for _ in range(NUM_DRIBBLERS)]
    for i, sock in enumerate(socks):
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\n" if i % 2 else body_head)
    open_socks = set(socks)
    deadline = time.monotonic() + IO_TIMEOUT_S
    try:
        while open_socks and time.monotonic() < deadline:
            readable, _, _ = select.select(list(open_socks), [], [], 0.1)
            for sock in readable:
                try:
                    if not sock.recv(CHUNK_BYTES):
                        open_socks.discard(sock)
                except ConnectionResetError:
                    open_socks.discard(sock)
            for sock in open_socks - set(readable):
                try:
                    sock.sendall(b"x")  # a header-name byte, or a body byte
                except OSError:
                    open_socks.discard(sock)
        assert not open_socks, f"{len(open_socks)} of {NUM_DRIBBLERS} still held"
    finally:
        for sock in socks:
            sock.close()
    assert live(port) == 200


@pytest.mark.parametrize("authorization", [b"Authorization: Bearer \r\n", b""])
def test_empty_admin_token_does_not_open_the_management_api(
    port: int, authorization: bytes
) -> None:
    # raw: httpx refuses to send the header value "Bearer " (trailing space) that a client could
    request = (
        b"POST /v2/repository/index HTTP/1.1\r\nHost: a\r\n%sContent-Length: 2\r\n"
        b"Connection: close\r\n\r\n{}" % authorization
    )
    with connect(port) as sock:
        sock.sendall(request)
        assert status_of(read_to_close(sock)) == 403

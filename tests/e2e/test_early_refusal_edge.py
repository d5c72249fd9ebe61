"""The edge's early 503 against a real `fulcrum serve`: a request to a model whose queue is full
is answered from its head, before its body is decoded (503, Retry-After, the client's request
id), the connection stays usable for the next request (the unread body is skipped), and the
refusal is counted."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fulcrum.demo import free_port, wait_ready

pytestmark = pytest.mark.e2e

SLOW_ECHO = """platform = "echo"
max_batch_size = 1
inputs = [{name = "x", datatype = "FP32", shape = [1]}]
outputs = [{name = "x", datatype = "FP32", shape = [1]}]
[parameters]
latency_a_ms = 1500
[dynamic_batching]
default_queue_policy = {max_queue_size = 1}
"""
BODY = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 1], "data": [1.5]}]}'


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root: Path = tmp_path_factory.mktemp("early")
    (root / "models" / "slow" / "1").mkdir(parents=True)
    (root / "models" / "slow" / "config.toml").write_text(SLOW_ECHO)
    port = free_port()
    with (root / "server.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fulcrum.cli", "serve", "--repository",
             str(root / "models"), "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc, timeout_s=120)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.kill()
            proc.wait()
    assert "Traceback" not in (root / "server.log").read_text()


def read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length body, read off a keep-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def keep_busy(infer: str, stop: threading.Event) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            client.post(infer, content=BODY)


def test_a_full_queue_answers_from_the_head_and_the_connection_stays_usable(url: str) -> None:
    infer = f"{url}/v2/models/slow/infer"
    # Three clients in a loop: one request runs (1.5 s), one waits, the queue (bound 1) is full.
    stop = threading.Event()
    busy = [threading.Thread(target=keep_busy, args=(infer, stop)) for _ in range(3)]
    for thread in busy:
        thread.start()
    port = int(url.rsplit(":", 1)[1])
    # Not JSON: the full path would answer 400 after decoding it; only the head's 503 skips it.
    garbage = b"<not json>" * 100
    head = (b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: a\r\nX-Request-Id: abc-1\r\n"
            b"Content-Length: %d\r\n\r\n" % len(garbage))  # fmt: skip
    try:
        # Until the busy clients fill the queue (on a loaded machine their first requests can
        # take a while to arrive; 100 quick tries once ran out before they did).
        deadline_s = time.monotonic() + 30.0
        while time.monotonic() < deadline_s:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(head + garbage)
                refused = read_response(sock)
                if refused.startswith(b"HTTP/1.1 400 "):
                    time.sleep(0.01)  # decoded: the queue was not full yet, or between requests
                    continue
                assert refused.startswith(b"HTTP/1.1 503 "), refused
                lower = refused.lower()
                assert b"\r\nretry-after: " in lower and b"\r\nx-request-id: abc-1\r\n" in lower
                assert b'"error":"queue for priority level 1 is full' in refused
                # The same connection serves the next request: the refused body was skipped.
                sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: a\r\n\r\n")
                assert read_response(sock).startswith(b"HTTP/1.1 200 ")
                break
        else:
            raise AssertionError("never refused")
    finally:
        stop.set()
        for thread in busy:
            thread.join()
    stats = httpx.get(f"{url}/v2/models/slow/stats", timeout=10).json()["model_stats"][0]
    assert stats["policy"]["shed"]["queue_full"] >= 1
    assert httpx.post(infer, content=BODY, timeout=30).status_code == 200  # drained: served

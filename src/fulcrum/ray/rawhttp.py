"""An HTTP request carried whole from the ingress to a replica, run there through the replica's
own Starlette app, and its response streamed back in pieces (the head, then body chunks). The
OpenAI generation routes go this way: their prompt preparation and token stream belong to the
engine, which lives only on the model's replicas."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import ASGIApp, Message

# A body chunk is bytes; the head is the first item of every stream.


@dataclass(frozen=True, slots=True)
class RawRequest:
    """What the replica's app needs to answer as the ingress would have."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass(frozen=True, slots=True)
class ResponseHead:
    status: int
    headers: list[tuple[bytes, bytes]]


async def run_asgi(app: ASGIApp, request: RawRequest) -> AsyncIterator[ResponseHead | bytes]:
    """Run `request` through `app`, yielding the response head and then its body chunks. When
    the consumer stops early (the client went away), the app sees `http.disconnect`."""
    out: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    sent_body = False

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await out.put(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path,
        "raw_path": request.path.encode(), "query_string": request.query,
        "root_path": "", "headers": request.headers,
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
    }  # fmt: skip

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await out.put(None)

    task = asyncio.ensure_future(run())
    try:
        while (message := await out.get()) is not None:
            item = _item(message)
            if item is not None:
                yield item
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                break
        await task
    finally:
        gone.set()
        if not task.done():
            task.cancel()


def _item(message: Message) -> ResponseHead | bytes | None:
    """What a message of the app's gives the stream: the head, a body chunk, or nothing."""
    if message["type"] == "http.response.start":
        return ResponseHead(message["status"], list(message.get("headers", [])))
    if message["type"] == "http.response.body" and message.get("body"):
        return bytes(message["body"])
    return None

"""`until_disconnect`: the work runs in the handler's own task; a client that leaves cancels it."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from fulcrum.server.http import ClientGone, until_disconnect

SCOPE = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}


def request_that_leaves(left: asyncio.Event) -> Request:
    """A request whose body was read; its next ASGI message is a disconnect once `left` is set."""

    async def receive() -> dict[str, object]:
        await left.wait()
        return {"type": "http.disconnect"}

    return Request(SCOPE, receive)


async def test_the_answer_comes_back_and_the_handler_is_not_cancelled_later() -> None:
    left = asyncio.Event()
    handler = asyncio.current_task()
    assert handler is not None

    async def work() -> int:
        assert asyncio.current_task() is handler  # no task of its own
        return 7

    assert await until_disconnect(request_that_leaves(left), work()) == 7
    left.set()  # the client leaves once it has its answer: nothing is cancelled any more
    for _ in range(5):
        await asyncio.sleep(0)
    assert handler.cancelling() == 0


async def test_a_client_that_leaves_cancels_the_work_and_gets_client_gone() -> None:
    left = asyncio.Event()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def work() -> int:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 0

    async def leave() -> None:
        await started.wait()
        left.set()

    leaving = asyncio.ensure_future(leave())
    with pytest.raises(ClientGone):
        await until_disconnect(request_that_leaves(left), work())
    await leaving
    assert cancelled.is_set()
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0  # the handler goes on to answer 499


async def test_the_server_cancelling_the_handler_stays_a_cancellation() -> None:
    left = asyncio.Event()

    async def handler() -> int:
        async def work() -> int:
            await asyncio.sleep(3600)
            return 0

        return await until_disconnect(request_that_leaves(left), work())

    task = asyncio.ensure_future(handler())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_error_in_the_work_is_raised_as_is() -> None:
    async def work() -> int:
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        await until_disconnect(request_that_leaves(asyncio.Event()), work())

"""input_pending on the transports the server (uvloop) and the client (asyncio or uvloop) use:
bytes or an end of stream the loop has not read yet are found; nothing waiting is not."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest
import uvloop

from fulcrum.pending_input import input_pending


class Idle(asyncio.Protocol):
    pass


async def check_on_running_loop() -> list[bool]:
    (sending, sender), (ending, ender) = socket.socketpair(), socket.socketpair()
    loop = asyncio.get_running_loop()
    with sender, ender:
        gets_bytes, _ = await loop.connect_accepted_socket(Idle, sending)
        gets_end, _ = await loop.connect_accepted_socket(Idle, ending)
        seen = [input_pending(gets_bytes), input_pending(gets_end)]
        sender.sendall(b"GET / HTTP/1.1\r\n")  # no await from here: the loop reads nothing
        ender.close()
        seen += [input_pending(gets_bytes), input_pending(gets_end)]
        gets_bytes.close()
        gets_end.close()
        await asyncio.sleep(0)
        seen += [input_pending(gets_bytes)]  # closed: nothing more can be read from it
    return seen


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_unread_bytes_and_end_of_stream_are_found(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    loop = new_loop()
    try:
        assert loop.run_until_complete(check_on_running_loop()) == [False, False, True, True, False]
    finally:
        loop.close()


def test_a_transport_without_a_socket_has_nothing_pending() -> None:
    class NoSocket(asyncio.BaseTransport):
        pass

    assert input_pending(NoSocket()) is False

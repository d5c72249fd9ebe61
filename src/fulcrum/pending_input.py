"""Whether a connection's socket holds input its event loop has not read yet.

An idle keep-alive connection is closed by one end while the other may already be using it
(RFC 9112 9.6); both ends ask this, once, at that moment: the server before its idle timer
closes a connection, the client before it reuses a pooled one.
"""

from __future__ import annotations

import asyncio
import select


def input_pending(transport: asyncio.BaseTransport) -> bool:
    """True when a read would not block: bytes, the peer's end of stream, or an error, waiting
    unread. False when nothing waits or the transport has no socket (a test's fake)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    fd = sock.fileno()
    if fd < 0:  # closed already: nothing more will be read from it
        return False
    # poll, not select: select cannot take a descriptor above 1023, a busy server's are
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))

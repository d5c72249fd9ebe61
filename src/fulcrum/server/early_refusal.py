"""Refusing a KServe v2 inference under overload from its request head alone.

Under overload most requests are refused, and each refusal taken down the full path (Starlette's
stack, the body read and decoded, the service, the batcher) costs the event loop a few hundred
microseconds that the model's own work and the health probes then lack. The connection asks this
gate when a request head is complete and another request is in progress (`server.limits`: on an
idle server nothing could be refused); when the model's queue would refuse even a one-row request
(`Service.early_refusal`), the 503 with its Retry-After goes out at once, without the app.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Any, cast

import msgspec
from starlette.datastructures import Headers

from fulcrum.context import REQUEST_ID_HEADER, context_from_headers
from fulcrum.errors import FulcrumError
from fulcrum.server.http import error_body

if TYPE_CHECKING:
    from uvicorn._types import (
        ASGI3Application,
        ASGIReceiveCallable,
        ASGISendCallable,
        HTTPScope,
        Scope,
    )

    from fulcrum.service import Service

# The v2 inference routes (server/v2.py); streaming rows (`infer_stream`) take the full path.
_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([0-9]{1,9}))?/infer")


class EarlyRefusal:
    """`gate(scope)`: an ASGI app answering the request head with a 503 now, or None to run the
    server's app."""

    def __init__(self, service: Service) -> None:
        self._service = service

    def __call__(self, scope: HTTPScope) -> ASGI3Application | None:
        if scope["method"] != "POST":
            return None
        match = _INFER_PATH.fullmatch(scope["path"])
        if match is None:
            return None
        headers = Headers(scope=cast("dict[str, Any]", scope))
        try:
            ctx = context_from_headers(headers, api="v2", now_s=time.monotonic())
        except FulcrumError:
            return None  # a bad header: the full path answers 400 naming it
        version = match.group(2)
        refusal = self._service.early_refusal(
            ctx, match.group(1), None if version is None else int(version)
        )
        if refusal is None:
            return None
        request_id = headers.get(REQUEST_ID_HEADER)
        if request_id is not None and not (request_id.isascii() and len(request_id) <= 128):
            request_id = None
        return _refusing_app(refusal, error_body(scope["path"], refusal), request_id)


def _refusing_app(exc: FulcrumError, body: object, request_id: str | None) -> ASGI3Application:
    """Answers `exc` as the full path would (status, JSON body, Retry-After, the client's
    request id) without reading the request body."""
    content = msgspec.json.encode(body)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(content)).encode()),
        *((k.lower().encode(), v.encode()) for k, v in exc.headers().items()),
    ]
    if request_id is not None:
        headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))

    async def app(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        await send({"type": "http.response.start", "status": exc.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": content, "more_body": False})

    return app

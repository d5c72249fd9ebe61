"""The routes the ingress answers differently from a single process, placed before the ordinary
app's: statistics and `/metrics` gathered from every replica, and the OpenAI generation routes
carried whole to the model's replicas and streamed back through a streaming handle."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from fulcrum.errors import DeadlineExceeded, InvalidInput
from fulcrum.ray.forward import classify
from fulcrum.ray.ingress import RayService
from fulcrum.ray.rawhttp import RawRequest, ResponseHead
from fulcrum.server.http import endpoint, json_response, read_body, request_context
from fulcrum.server.v2 import _version

log = logging.getLogger(__name__)
MAX_OPENAI_BODY_BYTES = 8 * 1024 * 1024  # as server/openai.py
# Carried whole to the model's replicas: what needs the model's engine or tokenizer.
FORWARDED = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


class _ModelField(msgspec.Struct):
    model: str = ""


def add_ray_routes(app: Starlette, service: RayService) -> None:
    """Put the ingress's own routes ahead of the app's (Starlette takes the first match)."""
    app.router.routes[:0] = ray_routes(service)


def ray_routes(service: RayService) -> list[BaseRoute]:
    async def statistics(request: Request) -> Response:
        ctx = request_context(request, "v2")
        name = request.path_params.get("model")
        figures = await service.statistics_of_replicas(ctx, name, _version(request))
        return json_response(figures)

    async def metrics(request: Request) -> Response:
        own = generate_latest(service.metrics.registry)
        return Response(own + await service.metrics_of_replicas(), media_type=CONTENT_TYPE_LATEST)

    async def carried(request: Request) -> Response:
        return await forward_http(service, request)

    m, mv = "/v2/models/{model}", "/v2/models/{model}/versions/{version}"
    routes: list[BaseRoute] = [
        Route(path, endpoint(statistics), methods=["GET"])
        for path in ("/v2/models/stats", f"{m}/stats", f"{mv}/stats")
    ]
    routes.append(Route("/metrics", endpoint(metrics), methods=["GET"]))
    routes.extend(Route(path, endpoint(carried), methods=["POST"]) for path in FORWARDED)
    return routes


async def forward_http(service: RayService, request: Request) -> Response:
    """The request run by one replica of the model its body names; a streamed answer (SSE) is
    relayed chunk by chunk, and a client that leaves cancels the replica's stream."""
    body = await read_body(request, MAX_OPENAI_BODY_BYTES)
    try:
        name = msgspec.json.decode(body, type=_ModelField).model
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidInput(f"request body: {exc}") from None
    service._check_open()
    handle = service.handle(name)
    raw = RawRequest(
        request.method, request.url.path, request.url.query.encode(),
        list(request.headers.raw), body,
    )  # fmt: skip
    stream = handle.options(stream=True).http.remote(raw)
    timeout_s = service.call.timeout_s
    try:
        head = await _next(stream, timeout_s)
    except BaseException:
        stream.cancel()
        raise
    if not isinstance(head, ResponseHead):
        stream.cancel()
        raise InvalidInput("the replica's answer began without a response head")
    if not any(k.lower() == b"content-type" and b"event-stream" in v for k, v in head.headers):
        chunks = [chunk async for chunk in _rest(stream, timeout_s, relay=False)]
        response = Response(b"".join(chunks), status_code=head.status)
        response.raw_headers = list(head.headers)
        return response
    streamed = StreamingResponse(_rest(stream, timeout_s), status_code=head.status)
    streamed.raw_headers = [(k, v) for k, v in head.headers if k.lower() != b"content-length"]
    return streamed


async def _next(stream: Any, timeout_s: float) -> object:
    try:
        return await asyncio.wait_for(stream.__anext__(), timeout_s)
    except TimeoutError:
        raise DeadlineExceeded(
            f"no answer from the model's replica within {timeout_s:g} s"
        ) from None
    except StopAsyncIteration:
        raise
    except Exception as exc:
        raise classify(exc, "the model's replica") from exc


async def _rest(stream: Any, timeout_s: float, *, relay: bool = True) -> AsyncIterator[bytes]:
    """The body chunks. Relayed (the head already sent), a replica lost mid-stream ends the
    stream; collected, its error is the answer."""
    try:
        while True:
            try:
                chunk = await _next(stream, timeout_s)
            except StopAsyncIteration:
                return
            if isinstance(chunk, bytes):
                yield chunk
    except Exception as exc:
        if not relay:
            raise
        log.warning("stream from the model's replica ended early: %s", exc)
    finally:
        stream.cancel()

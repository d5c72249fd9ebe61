"""KServe v2 / Open Inference Protocol routes, with Triton's repository and statistics APIs."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from fulcrum.cache.tiered import CACHE_HEADER, CachedResult
from fulcrum.context import RequestContext
from fulcrum.errors import Forbidden, FulcrumError, InvalidInput
from fulcrum.protocol import InferRequest, decode_infer_request, encode_infer_response
from fulcrum.protocol.stream import (
    EVENT_STREAM_TYPE,
    check_json_outputs,
    encode_error_event,
    encode_rows_event,
)
from fulcrum.router import ROUTE_HEADER
from fulcrum.server.http import (
    Endpoint,
    endpoint,
    json_response,
    off_loop_if_large,
    parse_count,
    parse_json,
    read_body,
    request_context,
    until_disconnect,
)
from fulcrum.service import Service

log = logging.getLogger(__name__)
MAX_MANAGEMENT_BODY_BYTES = 1 << 20


def _version(request: Request) -> int | None:
    raw = request.path_params.get("version")
    if raw is None or raw == "":
        return None
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18 or int(raw) < 1:
        raise InvalidInput(f"model version must be a positive integer, got {raw[:32]!r}")
    return int(raw)


class V2Api:
    """The v2 endpoints over `service`; `admin_allowed(request) -> bool` guards management."""

    def __init__(self, service: Service, admin_allowed: Callable[[Request], bool]) -> None:
        self.service = service
        self.admin_allowed = admin_allowed

    def routes(self) -> list[BaseRoute]:
        m, mv = "/v2/models/{model}", "/v2/models/{model}/versions/{version}"
        # Starlette tries routes in order: the hot infer routes go first.
        table: list[tuple[str, Endpoint, list[str]]] = [
            (f"{m}/infer", self.infer, ["POST"]),
            (f"{mv}/infer", self.infer, ["POST"]),
            (f"{m}/infer_stream", self.infer_stream, ["POST"]),
            (f"{mv}/infer_stream", self.infer_stream, ["POST"]),
            ("/v2/health/live", self.live, ["GET"]),
            ("/v2/health/ready", self.ready, ["GET"]),
            ("/v2", self.server_metadata, ["GET"]),
            ("/v2/models/stats", self.statistics, ["GET"]),
            (m, self.model_metadata, ["GET"]),
            (mv, self.model_metadata, ["GET"]),
            (f"{m}/ready", self.model_ready, ["GET"]),
            (f"{mv}/ready", self.model_ready, ["GET"]),
            (f"{m}/config", self.model_config, ["GET"]),
            (f"{mv}/config", self.model_config, ["GET"]),
            (f"{m}/stats", self.statistics, ["GET"]),
            (f"{mv}/stats", self.statistics, ["GET"]),
            ("/v2/repository/index", self.repository_index, ["POST"]),
            ("/v2/repository/models/{model}/load", self.load, ["POST"]),
            ("/v2/repository/models/{model}/unload", self.unload, ["POST"]),
        ]
        return [Route(path, endpoint(fn), methods=methods) for path, fn, methods in table]

    async def live(self, request: Request) -> Response:
        return Response(status_code=200 if self.service.is_live else 503)

    async def ready(self, request: Request) -> Response:
        return Response(status_code=200 if self.service.is_ready else 503)

    async def server_metadata(self, request: Request) -> Response:
        return json_response(self.service.server_metadata())

    async def model_metadata(self, request: Request) -> Response:
        ctx = request_context(request, "v2")
        name = request.path_params["model"]
        return json_response(self.service.model_metadata(ctx, name, _version(request)))

    async def model_ready(self, request: Request) -> Response:
        ctx = request_context(request, "v2")
        ok = self.service.model_ready(ctx, request.path_params["model"], _version(request))
        return Response(status_code=200 if ok else 400)

    async def model_config(self, request: Request) -> Response:
        ctx = request_context(request, "v2")
        return json_response(self.service.model_config(ctx, request.path_params["model"]))

    async def _decode(self, request: Request) -> tuple[bytes, InferRequest]:
        """The body and its infer request (JSON, or the binary-tensor extension)."""
        body = await read_body(request, self.service.settings.max_body_bytes)
        raw_length = request.headers.get("inference-header-content-length")
        header_length = (
            None if raw_length is None
            else parse_count(raw_length, "Inference-Header-Content-Length")
        )  # fmt: skip
        return body, await off_loop_if_large(len(body), decode_infer_request, body, header_length)

    async def infer(self, request: Request) -> Response:
        ctx = request_context(request, "v2")
        name = request.path_params["model"]
        version = _version(request)
        body, infer_request = await self._decode(request)
        served, result = await until_disconnect(
            request, self.service.infer(ctx, name, version, infer_request)
        )
        payload, headers = await off_loop_if_large(
            len(body), encode_infer_response,
            name, str(served), infer_request.id, result.outputs, infer_request.outputs,
            infer_request.binary_output_default,
        )  # fmt: skip
        # total: from the handler's start to the response built; what is neither queue nor
        # compute in it is the server's own path (decode, enqueue, hand-back, encode).
        total_ms = 0.0 if ctx.received_s is None else (time.monotonic() - ctx.received_s) * 1e3
        headers["Server-Timing"] = (
            f"queue;dur={result.queue_s * 1e3:.3f}, compute;dur={result.compute_s * 1e3:.3f}, "
            f"batch;desc={result.batch_size}, total;dur={total_ms:.3f}"
        )
        if result.route is not None:
            headers[ROUTE_HEADER] = result.route
        if isinstance(result, CachedResult):
            headers[CACHE_HEADER] = result.cache
            headers["Server-Timing"] += f", cache;dur={result.cache_s * 1e3:.3f}"
        return Response(payload, headers=headers)

    async def infer_stream(self, request: Request) -> Response:
        """`/infer`'s body answered as server-sent events, one per chunk of rows, in row order;
        errors before the first row are ordinary error responses."""
        ctx = request_context(request, "v2")
        name = request.path_params["model"]
        version = _version(request)
        _, infer_request = await self._decode(request)
        check_json_outputs(infer_request)
        stream = await self.service.infer_stream(ctx, name, version, infer_request)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield encode_rows_event(
                        name, str(stream.version), infer_request.id, chunk.result.outputs,
                        infer_request.outputs, row_offset=chunk.span.row_offset,
                        num_rows=chunk.span.num_rows, final=chunk.final,
                    )  # fmt: skip
            except FulcrumError as exc:  # a later chunk failed: the rest is cancelled; say so
                yield encode_error_event(exc.message, exc.status_code)
            except Exception:
                log.exception("stream of %s failed", request.url.path)
                yield encode_error_event("internal server error", 500)

        response = _EventStream(events(), on_close=stream.aclose)
        if stream.route is not None:
            response.headers[ROUTE_HEADER] = stream.route
        return response

    async def statistics(self, request: Request) -> Response:
        ctx = request_context(request, "v2")
        name = request.path_params.get("model")
        return json_response(self.service.statistics(ctx, name, _version(request)))

    async def repository_index(self, request: Request) -> Response:
        ctx = self._management_context(request)
        body = parse_json(await read_body(request, MAX_MANAGEMENT_BODY_BYTES), "repository index")
        return json_response(self.service.model_index(ctx, ready_only=bool(body.get("ready"))))

    async def load(self, request: Request) -> Response:
        ctx = self._management_context(request)
        body = parse_json(await read_body(request, MAX_MANAGEMENT_BODY_BYTES), "load request")
        await self.service.load(ctx, request.path_params["model"], _config_override(body))
        return json_response({})

    async def unload(self, request: Request) -> Response:
        ctx = self._management_context(request)
        await self.service.unload(ctx, request.path_params["model"])
        return json_response({})

    def _management_context(self, request: Request) -> RequestContext:
        if not self.admin_allowed(request):
            raise Forbidden("management API needs the admin token on this address (--admin-token)")
        return request_context(request, "management")


class _EventStream(StreamingResponse):
    """An SSE response that runs `on_close` however it ends: finished, failed, or cut off by a
    client that went away (Starlette cancels the body iterator then, without closing it)."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]):
        super().__init__(
            events, media_type=EVENT_STREAM_TYPE, headers={"Cache-Control": "no-cache"}
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


def _config_override(body: dict[str, object]) -> dict[str, object] | None:
    """Triton's load request may carry `parameters.config`: a JSON (or TOML) config text."""
    params = body.get("parameters")
    if not isinstance(params, dict) or "config" not in params:
        return None
    text = params["config"]
    if isinstance(text, dict):
        return text
    if not isinstance(text, str):
        raise InvalidInput("parameters.config must be a JSON or TOML string")
    try:
        value = (
            msgspec.json.decode(text)
            if text.lstrip().startswith("{")
            else msgspec.toml.decode(text)
        )
    except msgspec.DecodeError as exc:
        raise InvalidInput(f"parameters.config is neither JSON nor TOML: {exc}") from None
    except RecursionError:
        raise InvalidInput("parameters.config: nested too deeply") from None
    if not isinstance(value, dict):
        raise InvalidInput("parameters.config must be an object")
    return value

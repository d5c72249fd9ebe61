"""HTTP plumbing shared by every route: the one error renderer (v2 or OpenAI shape by path), the
one endpoint wrapper, the one disconnect watcher, the request context, bounded body reads."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from functools import wraps
from typing import Any, TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from fulcrum.context import REQUEST_ID_HEADER, RequestContext, context_from_headers
from fulcrum.errors import FulcrumError, InvalidInput, NotFound, PayloadTooLarge, Unavailable

log = logging.getLogger(__name__)
Endpoint = Callable[[Request], Awaitable[Response]]
T = TypeVar("T")
_json = msgspec.json.Encoder()
OPENAI_PREFIX = "/v1/"
# vLLM's routes outside /v1 answer errors in OpenAI's shape too.
OPENAI_PATHS = frozenset({"/v1", "/tokenize", "/detokenize"})
# OpenAI's error `type` by status; v2 errors are `{"error": message}`.
_OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away first"


def json_response(content: object, status_code: int = 200) -> Response:
    return Response(_json.encode(content), status_code, media_type="application/json")


def error_body(path: str, exc: FulcrumError) -> dict[str, Any]:
    """The error body for `path`: OpenAI's shape under /v1/, KServe v2's elsewhere; never a
    stack trace."""
    if path.startswith(OPENAI_PREFIX) or path in OPENAI_PATHS:
        kind = _OPENAI_ERROR_TYPES.get(exc.status_code, "server_error")  # OpenAI's type for 5xx
        param = getattr(exc, "param", None)  # OpenAI's body always carries it, null or a field
        return {
            "error": {"message": exc.message, "type": kind, "param": param, "code": exc.status_code}
        }
    return {"error": exc.message}


def error_response(path: str, exc: FulcrumError) -> Response:
    response = json_response(error_body(path, exc), exc.status_code)
    response.headers.update(exc.headers())
    return response


def endpoint(fn: Endpoint) -> Endpoint:
    """Wrap a route: map the error tree to responses, a client that left to a quiet 499, and
    anything unexpected to a logged, bare 500. Every route of both APIs goes through this."""

    @wraps(fn)
    async def wrapper(request: Request) -> Response:
        try:
            response = await fn(request)
        except FulcrumError as exc:
            response = error_response(request.url.path, exc)
        except (ClientDisconnect, ClientGone):
            # Anyone can trigger this at will: it is no server error and logs no traceback.
            log.debug("client left before the answer to %s", request.url.path)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.url.path)
            response = error_response(request.url.path, FulcrumError("internal server error"))
        # The id the route answered under (a body's request_id), else the client's header.
        request_id = getattr(request.state, "request_id", None) or request.headers.get(
            REQUEST_ID_HEADER
        )
        if request_id is not None and request_id.isascii() and len(request_id) <= 128:
            response.headers.setdefault(REQUEST_ID_HEADER, request_id)
        return response

    return wrapper


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 / 405 (no route, wrong method), shaped like every other error."""
    status = getattr(exc, "status_code", 404)
    error = (
        NotFound(f"no route {request.method} {request.url.path}")
        if status == 404
        else _MethodNotAllowed(f"{request.method} not allowed on {request.url.path}")
    )
    return error_response(request.url.path, error)


class _MethodNotAllowed(FulcrumError):
    status_code = 405


class ClientGone(Unavailable):
    """The client disconnected while its request waited or ran; nobody reads the answer."""


def request_context(request: Request, api: str) -> RequestContext:
    """The request's context, from its headers (InvalidInput names a bad one)."""
    return context_from_headers(request.headers, api=api, now_s=time.monotonic())


async def until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run `work`, cancelling it if the client goes away first: a queued request whose client
    left never runs, an LLM request is aborted and frees its KV blocks.

    `work` runs in the handler's own task, and a watcher task cancels that task when the client
    goes: no second task, and no wait on both, stands between the answer and the response (a
    lone request's path is two loop turns shorter)."""
    handler = asyncio.current_task()
    assert handler is not None, "until_disconnect runs in a task"
    running, gone = True, False

    def on_watched(watcher: asyncio.Future[None]) -> None:
        # Scheduled by the loop: the work may have ended since; then nothing is cancelled.
        nonlocal gone
        if running and not watcher.cancelled() and watcher.exception() is None:
            gone = True
            handler.cancel()

    watcher = asyncio.ensure_future(_wait_disconnect(request))
    watcher.add_done_callback(on_watched)
    try:
        return await work
    except asyncio.CancelledError:
        # Our own cancel is the only one pending: the client left. Any other (the server
        # shutting down) goes on as a cancellation.
        if gone and handler.uncancel() == 0:
            raise ClientGone("client disconnected") from None
        raise
    finally:
        running = False
        watcher.cancel()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass  # each receive waits for the next ASGI message; no polling


def parse_count(value: str, what: str) -> int:
    """A non-negative decimal integer in ASCII digits ('²' and '١' pass isdigit() alone)."""
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        raise InvalidInput(f"invalid {what} {value[:32]!r}: expected a non-negative integer")
    return int(value)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused with 413 before reading past `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None:
        size = parse_count(declared, "Content-Length")
        if size > max_bytes:
            raise PayloadTooLarge(f"request body of {size} bytes exceeds {max_bytes} bytes")
        return await request.body()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(f"request body exceeds {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(body: bytes, what: str) -> dict[str, object]:
    """A JSON object from a management request body (empty body: {})."""
    if not body.strip():
        return {}
    try:
        value = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidInput(f"{what}: malformed JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput(f"{what}: malformed JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise InvalidInput(f"{what}: expected a JSON object")
    return value


# Past this size a body is decoded on a worker thread, so the loop keeps serving meanwhile.
LARGE_BODY_BYTES = 1 << 20


async def off_loop_if_large(size: int, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, on a worker thread when the body it decodes is large."""
    if size > LARGE_BODY_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)

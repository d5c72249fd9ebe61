"""HTTP plumbing shared by the route modules: error mapping, bounded body reads, JSON replies."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import wraps

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from fulcrum.errors import FulcrumError, InvalidInput, PayloadTooLarge

log = logging.getLogger(__name__)
Endpoint = Callable[[Request], Awaitable[Response]]
_json = msgspec.json.Encoder()


def json_response(content: object, status_code: int = 200) -> Response:
    return Response(_json.encode(content), status_code, media_type="application/json")


def error_response(exc: FulcrumError) -> Response:
    """`{"error": message}` with the error's status and headers; never a stack trace."""
    response = json_response({"error": exc.message}, exc.status_code)
    response.headers.update(exc.headers())
    return response


def handle_errors(endpoint: Endpoint) -> Endpoint:
    """Map the error tree to responses; anything unexpected is a logged, bare 500."""

    @wraps(endpoint)
    async def wrapper(request: Request) -> Response:
        try:
            return await endpoint(request)
        except FulcrumError as exc:
            return error_response(exc)
        except Exception:
            log.exception("unhandled error on %s %s", request.method, request.url.path)
            return json_response({"error": "internal server error"}, 500)

    return wrapper


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused with 413 before reading past `max_bytes`."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise InvalidInput(f"invalid Content-Length {declared!r}")
        if int(declared) > max_bytes:
            raise PayloadTooLarge(f"request body of {declared} bytes exceeds {max_bytes} bytes")
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
    if not isinstance(value, dict):
        raise InvalidInput(f"{what}: expected a JSON object")
    return value

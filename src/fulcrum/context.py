"""The request context: who asks, by when, how urgently, which variant, lane or A/B arm; built
once at the edge from headers (both APIs) and read by the service, the router and the cache."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from fulcrum.errors import DeadlineExceeded, InvalidInput

REQUEST_ID_HEADER = "x-request-id"
TENANT_HEADER = "x-fulcrum-tenant"
TIMEOUT_HEADER = "x-fulcrum-timeout-ms"
PRIORITY_HEADER = "x-fulcrum-priority"
LANE_HEADER = "x-fulcrum-lane"
AB_KEY_HEADER = "x-fulcrum-ab-key"
VARIANT_HEADER = "x-fulcrum-variant"
MAX_LABEL_CHARS = 128  # tenant, lane, A/B key and request id: bounded, printable ASCII
DEFAULT_TENANT = "default"
# The headers a context reads. Most requests carry none of them: one pass over the headers
# finds that, where a lookup per name scans them all each time (Starlette's Headers): 17 us of
# a request's path against 3 (issue 11).
_CONTEXT_HEADERS = frozenset({
    REQUEST_ID_HEADER, TENANT_HEADER, TIMEOUT_HEADER, PRIORITY_HEADER, LANE_HEADER,
    AB_KEY_HEADER, VARIANT_HEADER, "authorization",
})  # fmt: skip


class _RequestIds:
    """Ids for requests that bring none: 32 hex digits, as a UUID4's, from a random prefix per
    process and a counter (os.urandom and a UUID per request cost 3.4 us, this 0.4)."""

    def __init__(self) -> None:
        self._reseed()
        os.register_at_fork(after_in_child=self._reseed)  # a forked child gets its own prefix

    def _reseed(self) -> None:
        self._prefix = os.urandom(8).hex()
        self._counter = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter) & 0xFFFF_FFFF_FFFF_FFFF:016x}"


new_request_id = _RequestIds().next


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What the service knows about a request besides its payload."""

    request_id: str
    tenant: str  # from X-Fulcrum-Tenant, else derived from the API key, else "default"
    api: str  # "v2", "openai" or "management"
    deadline_s: float | None = None  # absolute time.monotonic() value
    priority: int | None = None  # None: the model's default
    lane: str | None = None
    ab_key: str | None = None
    variant: str | None = None  # None: the model's default variant
    received_s: float | None = None  # time.monotonic() when it reached the server; SLOs count
    # from here, so time spent reading and decoding the body is not hidden from the batch policy
    num_rows: int = 1  # rows it carries (v2 batch rows, embedding inputs): the lane estimate's

    def remaining_s(self, now_s: float) -> float | None:
        """Seconds left before the deadline (None: no deadline); 504 once it has passed."""
        if self.deadline_s is None:
            return None
        left_s = self.deadline_s - now_s
        if left_s <= 0:
            raise DeadlineExceeded(f"request {self.request_id} passed its deadline before it ran")
        return left_s

    def age_s(self, now_s: float) -> float:
        """Seconds since the request reached the server (0 for internal calls)."""
        return 0.0 if self.received_s is None else max(0.0, now_s - self.received_s)

    def timeout_s(self, own_timeout_s: float | None, now_s: float) -> float | None:
        """The tighter of the context's deadline and a protocol-level timeout (v2 `timeout`)."""
        left_s = self.remaining_s(now_s)
        if left_s is None:
            return own_timeout_s
        return left_s if own_timeout_s is None else min(left_s, own_timeout_s)


def context_from_headers(headers: Mapping[str, str], *, api: str, now_s: float) -> RequestContext:
    """Build the context from (lower-case) HTTP headers; InvalidInput names a bad header."""
    present: dict[str, str] = {}
    for name, value in headers.items():
        if name in _CONTEXT_HEADERS:
            present.setdefault(name, value)  # the first of repeated ones, as `get` gives
    if not present:
        return RequestContext(new_request_id(), DEFAULT_TENANT, api, received_s=now_s)
    headers = present
    timeout_ms = _number(headers, TIMEOUT_HEADER)
    return RequestContext(
        request_id=_label(headers, REQUEST_ID_HEADER) or new_request_id(),
        tenant=_label(headers, TENANT_HEADER) or _tenant_of_key(headers) or DEFAULT_TENANT,
        api=api,
        deadline_s=None if timeout_ms is None else now_s + timeout_ms / 1000,
        priority=None if (p := _number(headers, PRIORITY_HEADER)) is None else int(p),
        lane=_label(headers, LANE_HEADER),
        ab_key=_label(headers, AB_KEY_HEADER),
        variant=_label(headers, VARIANT_HEADER),
        received_s=now_s,
    )


def _label(headers: Mapping[str, str], name: str) -> str | None:
    value = headers.get(name)
    if value is None or value == "":
        return None
    if len(value) > MAX_LABEL_CHARS or not (value.isascii() and value.isprintable()):
        raise InvalidInput(
            f"header {name}: at most {MAX_LABEL_CHARS} printable ASCII characters expected"
        )
    return value


def _number(headers: Mapping[str, str], name: str) -> float | None:
    value = headers.get(name)
    if value is None:
        return None
    # isdecimal() alone accepts '²' and '١'; a header is ASCII digits or nothing.
    if not (value.isascii() and value.isdigit()) or len(value) > 12:
        raise InvalidInput(f"header {name}: expected a non-negative integer, got {value[:32]!r}")
    return float(value)


def _tenant_of_key(headers: Mapping[str, str]) -> str | None:
    """An API key identifies its tenant by a digest: the key itself is never kept or shown."""
    auth = headers.get("authorization", "")
    scheme, _, key = auth.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return "key-" + hashlib.sha256(key.strip().encode()).hexdigest()[:16]


def internal_context(api: str = "internal") -> RequestContext:
    """A context for calls that do not come over HTTP (tools, tests, the service itself)."""
    return RequestContext(request_id=new_request_id(), tenant=DEFAULT_TENANT, api=api)


def with_rows(ctx: RequestContext, num_rows: int) -> RequestContext:
    """The context carrying the request's row count (the lane estimate's); the same context
    when the count is already its own (one row, the common case: no copy on the hot path)."""
    return ctx if num_rows == ctx.num_rows else dataclasses.replace(ctx, num_rows=num_rows)


def with_parameter(
    ctx: RequestContext, name: Literal["variant", "lane"], value: object
) -> RequestContext:
    """The context with a v2 request parameter that may also come as a header (`variant`,
    `lane`): a non-empty name that never contradicts the header."""
    if value is None:
        return ctx
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"parameter '{name}' must be a {name} name, got {value!r}")
    given = getattr(ctx, name)
    if given is not None and given != value:
        header = f"X-Fulcrum-{name.capitalize()}"
        raise InvalidInput(
            f"parameter '{name}' = {value!r} contradicts header {header} = {given!r}"
        )
    if name == "lane":
        return dataclasses.replace(ctx, lane=value)
    return dataclasses.replace(ctx, variant=value)

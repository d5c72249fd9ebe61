"""`context_from_headers`: one pass over the headers, the first of repeated ones, request ids."""

from __future__ import annotations

import os
import re

import pytest
from starlette.datastructures import Headers

from fulcrum.context import DEFAULT_TENANT, context_from_headers, new_request_id, with_rows
from fulcrum.errors import InvalidInput

HEX32 = re.compile(r"[0-9a-f]{32}")


def headers(*pairs: tuple[str, str]) -> Headers:
    """Starlette's view of raw request headers (repeats kept, in order)."""
    raw = [(b"host", b"a"), (b"content-type", b"application/json")]
    raw += [(name.encode(), value.encode()) for name, value in pairs]
    return Headers(raw=raw)


def test_a_request_without_context_headers_gets_defaults_and_a_fresh_id() -> None:
    one = context_from_headers(headers(), api="v2", now_s=5.0)
    two = context_from_headers(headers(), api="v2", now_s=5.0)
    assert (one.tenant, one.api, one.deadline_s, one.priority, one.received_s) == (
        DEFAULT_TENANT, "v2", None, None, 5.0,
    )  # fmt: skip
    assert HEX32.fullmatch(one.request_id) and HEX32.fullmatch(two.request_id)
    assert one.request_id != two.request_id


def test_context_headers_are_read_and_the_first_of_a_repeated_one_wins() -> None:
    ctx = context_from_headers(
        headers(("x-request-id", "r1"), ("x-fulcrum-timeout-ms", "250"),
                ("x-fulcrum-priority", "2"), ("x-request-id", "r2"),
                ("x-fulcrum-lane", "fast"), ("authorization", "Bearer k")),
        api="openai", now_s=10.0,
    )  # fmt: skip
    assert (ctx.request_id, ctx.deadline_s, ctx.priority, ctx.lane) == ("r1", 10.25, 2, "fast")
    assert ctx.tenant.startswith("key-")  # derived from the API key, never the key itself
    assert headers(("x-request-id", "r1"), ("x-request-id", "r2")).get("x-request-id") == "r1"


@pytest.mark.parametrize(
    ("name", "value"), [("x-fulcrum-timeout-ms", "١٠"), ("x-fulcrum-lane", "a\x01b")]
)
def test_a_bad_context_header_among_others_is_still_named(name: str, value: str) -> None:
    with pytest.raises(InvalidInput, match=name):
        context_from_headers(headers(("x-other", "1"), (name, value)), api="v2", now_s=0.0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_process_numbers_its_requests_under_its_own_prefix() -> None:
    parent = new_request_id()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write one id and leave at once
        os.write(write_end, new_request_id().encode())
        os._exit(0)
    os.close(write_end)
    child = os.read(read_end, 64).decode()
    os.close(read_end)
    os.waitpid(pid, 0)
    assert HEX32.fullmatch(child) and child[:16] != parent[:16]


def test_with_rows_keeps_the_context_for_its_own_count_and_copies_for_another() -> None:
    ctx = context_from_headers({}, api="v2", now_s=0.0)
    assert with_rows(ctx, 1) is ctx  # one row, the default: no copy
    many = with_rows(ctx, 64)
    assert (many.num_rows, ctx.num_rows, many.request_id) == (64, 1, ctx.request_id)
    assert with_rows(many, 64) is many

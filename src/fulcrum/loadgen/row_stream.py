"""The streamed KServe v2 target (`/infer_stream`): each row event's arrival is stamped, so a
run reports time to first rows (the first event after the scheduled send) beside the latency of
the whole answer. It reuses the LLM stream's arrival list: the `ttft` SLO bounds first rows."""

from __future__ import annotations

import time

import msgspec

from fulcrum.client import ClientError, Endpoint, Stream
from fulcrum.loadgen.kserve import PreparedRequest
from fulcrum.loadgen.records import Outcome
from fulcrum.loadgen.streaming import StreamSlot, StreamTarget


class _RowParameters(msgspec.Struct):
    num_rows: int = 0
    final: bool = False


class _RowEvent(msgspec.Struct):
    """What the client reads of an event; the tensors are skipped, not decoded."""

    parameters: _RowParameters | None = None
    error: str | None = None
    code: int = 500


_decode_event = msgspec.json.Decoder(_RowEvent).decode


async def read_row_events(stream: Stream, outcome: Outcome) -> None:
    """Consume a row stream to its end, stamping each row event's arrival and counting rows.
    An error event fails the request with its status; a stream without a final event is a
    ClientError."""
    buffer = b""
    final = failed = False
    outcome.num_rows = 0
    async for data in stream.chunks():
        now_s = time.perf_counter()
        buffer += data
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            payload = event.removeprefix(b"data:").strip()
            if not payload:
                continue
            try:
                decoded = _decode_event(payload)
            except msgspec.DecodeError as exc:
                raise ClientError(f"bad row event: {payload[:200]!r}") from exc
            if decoded.error is not None:
                outcome.status, outcome.error, failed = decoded.code, decoded.error[:200], True
            elif decoded.parameters is not None:
                outcome.token_times_s.append(now_s)
                outcome.num_rows += decoded.parameters.num_rows
                final = final or decoded.parameters.final
    if not final and not failed:
        raise ClientError("row stream ended without its final event")


class V2StreamTarget(StreamTarget):
    """Hands out slots that send the prepared streamed requests round-robin."""

    def __init__(self, endpoint: Endpoint, requests: list[PreparedRequest]) -> None:
        super().__init__(endpoint, [r.raw for r in requests], read_row_events)


V2StreamSlot = StreamSlot  # the slot is generic; the name stays for readers of this module

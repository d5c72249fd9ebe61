"""The streamed v2 target (`--stream-rows`): requests to /infer_stream, row events read as they
come, time to first rows summarized, reported and written; driven through a fake transport."""

from __future__ import annotations

import argparse
import asyncio
import csv
from pathlib import Path

import msgspec
import pytest
from rich.console import Console

from fulcrum.client import ClientError, Connection, Endpoint, _Protocol
from fulcrum.loadgen.cli import options_from_args, register
from fulcrum.loadgen.driver import RawPoint
from fulcrum.loadgen.inputs import ModelMeta
from fulcrum.loadgen.kserve import PreparedRequest, V2Inputs, prepare_v2
from fulcrum.loadgen.records import Outcome, RequestRecord
from fulcrum.loadgen.report import print_run, write_run
from fulcrum.loadgen.results import BenchRun, summarize_point
from fulcrum.loadgen.row_stream import V2StreamSlot, V2StreamTarget
from fulcrum.loadgen.server_stats import ServerSplit
from fulcrum.loadgen.windows import Measurement, MeasurePlan

ENDPOINT = Endpoint.from_url("http://127.0.0.1:8123")
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def row_event(offset: int, num_rows: int, *, final: bool) -> bytes:
    flag = b"true" if final else b"false"
    return (
        b'data: {"model_name":"m","outputs":[{"name":"y","datatype":"FP32","shape":[%d,1],'
        b'"data":[%s]}],"parameters":{"row_offset":%d,"num_rows":%d,"final":%s}}\n\n'
        % (num_rows, b",".join(b"1.0" for _ in range(num_rows)), offset, num_rows, flag)
    )


class FakeTransport:
    """Answers each write with the next scripted reply, one piece per loop turn."""

    def __init__(self, protocol: _Protocol, replies: list[list[bytes]]) -> None:
        self.protocol = protocol
        self.replies = replies
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written.append(data)
        if self.replies:
            asyncio.get_running_loop().create_task(self._deliver(self.replies.pop(0)))

    async def _deliver(self, pieces: list[bytes]) -> None:
        for piece in pieces:
            await asyncio.sleep(0)
            self.protocol.data_received(piece)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.protocol.connection_lost(None)

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default  # no socket: the client finds nothing waiting unread before a reuse


def slot_with(replies: list[list[bytes]]) -> tuple[V2StreamSlot, FakeTransport]:
    target = V2StreamTarget(ENDPOINT, [PreparedRequest(b"POST /x HTTP/1.1\r\n\r\n", 5)])
    slot = target.open_slot()
    protocol = _Protocol()
    transport = FakeTransport(protocol, replies)
    protocol.connection_made(transport)
    slot.connection = Connection(ENDPOINT)
    slot.connection._protocol = protocol
    return slot, transport


async def test_row_events_are_stamped_and_counted_even_split_across_chunks() -> None:
    first, last = row_event(0, 2, final=False), row_event(2, 3, final=True)
    pieces = [
        HEAD,
        chunk(first[:30]),
        chunk(first[30:] + last[:10]),
        chunk(last[10:]),
        b"0\r\n\r\n",
    ]
    slot, transport = slot_with([pieces])
    outcome = await slot.send(timeout_s=5.0)
    assert outcome.ok and outcome.num_rows == 5
    assert len(outcome.token_times_s) == 2
    assert outcome.token_times_s[0] <= outcome.token_times_s[1]
    assert not transport.closed  # the stream was read to its end: the connection stays usable


async def test_an_error_event_fails_the_request_with_its_status() -> None:
    error = b'data: {"error":"model failed: boom","code":500}\n\n'
    pieces = [HEAD, chunk(row_event(0, 2, final=False)), chunk(error), b"0\r\n\r\n"]
    slot, _ = slot_with([pieces])
    outcome = await slot.send(timeout_s=5.0)
    assert outcome.status == 500 and not outcome.ok
    assert "boom" in outcome.error and outcome.num_rows == 2


async def test_a_stream_without_its_final_event_is_a_client_error() -> None:
    slot, transport = slot_with([[HEAD, chunk(row_event(0, 2, final=False)), b"0\r\n\r\n"]])
    with pytest.raises(ClientError, match="final event"):
        await slot.send(timeout_s=5.0)
    assert transport.closed


async def test_an_error_before_the_stream_is_an_ordinary_response() -> None:
    body = b'{"error":"unknown input"}'
    head = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(body)
    slot, _ = slot_with([[head + body]])
    outcome = await slot.send(timeout_s=5.0)
    assert outcome.status == 400 and "unknown input" in outcome.error


def meta() -> ModelMeta:
    tensor = {"name": "x", "datatype": "FP32", "shape": [-1, 4]}
    return msgspec.convert({"name": "m", "inputs": [tensor], "outputs": [tensor]}, ModelMeta)


def test_streamed_requests_go_to_infer_stream_and_ask_for_json_outputs() -> None:
    streamed = prepare_v2(ENDPOINT, meta(), V2Inputs(batch_size=200, stream_rows=True, binary=True))
    raw = streamed[0].raw
    assert raw.startswith(b"POST /v2/models/m/infer_stream HTTP/1.1")
    assert b"Accept: text/event-stream" in raw
    assert b'"binary_data_output":false' in raw and b"Inference-Header-Content-Length" in raw
    assert streamed[0].num_rows == 200
    plain = prepare_v2(ENDPOINT, meta(), V2Inputs(batch_size=2))
    assert plain[0].raw.startswith(b"POST /v2/models/m/infer HTTP/1.1")


def record(scheduled_s: float, first_s: float, done_s: float) -> RequestRecord:
    outcome = Outcome(200, num_rows=200, token_times_s=[first_s, done_s])
    return RequestRecord(scheduled_s, scheduled_s, done_s, outcome)


def raw_point(records: list[RequestRecord]) -> RawPoint:
    measurement = Measurement(MeasurePlan(warmup_s=0.0, window_s=1.0, max_duration_s=1.0), 0.0)
    measurement.close_window(1.0, records)
    return RawPoint(measurement, client_cpu=0.1)


def test_time_to_first_rows_is_summarized_reported_and_written(tmp_path: Path) -> None:
    records = [record(i, i + 0.010, i + 0.100) for i in range(10)]
    point = summarize_point("concurrency", 1.0, raw_point(records), [], ServerSplit(),
                            stream_rows=True)  # fmt: skip
    assert point.first_rows is not None
    assert point.first_rows.p50_ms == pytest.approx(10.0) and point.first_rows.count == 10
    assert point.latency.p50_ms == pytest.approx(100.0)
    plain = summarize_point("concurrency", 1.0, raw_point(records), [], ServerSplit())
    assert plain.first_rows is None
    run = BenchRun(model="m", url="u", label="rows", stream_rows=True, points=[point])
    console = Console(width=200, record=True)
    print_run(run, console)
    assert "first rows p50" in console.export_text()
    write_run(run, tmp_path)
    [row] = list(csv.DictReader((tmp_path / "results.csv").read_text().splitlines()))
    assert float(row["first_rows_p50_ms"]) == pytest.approx(10.0)


def test_stream_rows_flag() -> None:
    parser = argparse.ArgumentParser(prog="fulcrum")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", "m", "--stream-rows", "--batch-size", "200"])
    options = options_from_args(args)
    assert options.v2.stream_rows and options.v2.batch_size == 200
    assert not options_from_args(parser.parse_args(["bench", "m"])).v2.stream_rows

"""Streamed rows without a server: how a request is cut, the order chunks come back in, what an
admission failure, a failing chunk and closing the stream do; with a fake `run` whose answers
the test releases one by one. And the event encoding of `protocol/stream.py`."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pytest

from fulcrum.batcher import InferResult
from fulcrum.config import ModelConfig, TensorSpec
from fulcrum.errors import InvalidInput, ModelError, QueueFull
from fulcrum.protocol import InferRequest, RequestedOutput
from fulcrum.protocol.stream import check_json_outputs, encode_error_event, encode_rows_event
from fulcrum.service_stream import (
    ChunkSizes,
    RowSpan,
    chunk_sizes,
    open_row_stream,
    plan_spans,
)
from fulcrum.types import TensorMap


def config(max_batch_size: int = 8) -> ModelConfig:
    spec = TensorSpec(name="x", datatype="FP32", shape=(2,))
    out = TensorSpec(name="y", datatype="FP32", shape=(2,))
    return ModelConfig(name="m", platform="echo", max_batch_size=max_batch_size, inputs=(spec,),
                       outputs=(out,))  # fmt: skip


def request(num_rows: int, **parameters: object) -> InferRequest:
    x = np.arange(num_rows * 2, dtype=np.float32).reshape(num_rows, 2)
    return InferRequest(id="r", inputs={"x": x}, outputs=(), binary_output_default=False,
                        priority=None, timeout_s=None, parameters=dict(parameters))  # fmt: skip


class FakeRun:
    """`run` for open_row_stream: each call waits until the test answers or fails it."""

    def __init__(self, refuse_from: int | None = None) -> None:
        self.calls: list[TensorMap] = []
        self.answers: list[asyncio.Future[None]] = []
        self.cancelled: list[int] = []
        self.refuse_from = refuse_from

    async def __call__(self, inputs: TensorMap) -> InferResult:
        index = len(self.calls)
        self.calls.append(inputs)
        if self.refuse_from is not None and index >= self.refuse_from:
            raise QueueFull("queue full")
        answer = asyncio.get_running_loop().create_future()
        self.answers.append(answer)
        try:
            await answer
        except asyncio.CancelledError:
            self.cancelled.append(index)
            raise
        return InferResult({"y": inputs["x"]}, 0.0, 0.0, len(inputs["x"]))


def test_default_sizes_follow_max_batch_size() -> None:
    assert chunk_sizes({}, 32) == ChunkSizes(8, 32)
    assert chunk_sizes({}, 4) == ChunkSizes(4, 4)
    assert chunk_sizes({"first_rows": 1, "chunk_rows": 3}, 4) == ChunkSizes(1, 3)
    for bad in ({"first_rows": 0}, {"chunk_rows": 5}, {"first_rows": True}, {"chunk_rows": "2"}):
        with pytest.raises(InvalidInput, match=r"1\.\.4"):
            chunk_sizes(bad, 4)


def test_spans_cover_every_row_once_in_order() -> None:
    spans = plan_spans(200, ChunkSizes(8, 32))
    assert [s.num_rows for s in spans] == [8, 32, 32, 32, 32, 32, 32]
    assert [s.row_offset for s in spans] == [0, 8, 40, 72, 104, 136, 168]
    assert plan_spans(5, ChunkSizes(8, 32)) == [RowSpan(0, 5)]


async def test_chunks_are_submitted_at_once_and_come_back_in_row_order() -> None:
    run = FakeRun()
    stream = await open_row_stream(config(), 3, request(20, first_rows=2), run)
    assert [len(c["x"]) for c in run.calls] == [2, 8, 8, 2]  # all queued before any answer
    for answer in reversed(run.answers[1:]):  # the later chunks finish first
        answer.set_result(None)
    first_waits = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0)
    assert not first_waits.done()  # row order: the first chunk is awaited first
    run.answers[0].set_result(None)
    chunks = [await first_waits] + [c async for c in stream]
    assert [(c.span.row_offset, c.span.num_rows, c.final) for c in chunks] == [
        (0, 2, False), (2, 8, False), (10, 8, False), (18, 2, True)
    ]  # fmt: skip
    rows = np.concatenate([c.result.outputs["y"] for c in chunks])
    assert np.array_equal(rows, request(20).inputs["x"]) and stream.version == 3


async def test_the_first_chunk_comes_while_the_rest_still_wait() -> None:
    run = FakeRun()
    stream = await open_row_stream(config(), 1, request(20, first_rows=2), run)
    run.answers[0].set_result(None)
    first = await anext(stream)
    assert first.span == RowSpan(0, 2) and not any(a.done() for a in run.answers[1:])
    await stream.aclose()
    assert sorted(run.cancelled) == [1, 2, 3]


async def test_a_refused_chunk_fails_the_request_before_the_stream_and_cancels_the_rest() -> None:
    run = FakeRun(refuse_from=2)
    with pytest.raises(QueueFull):
        await open_row_stream(config(), 1, request(20, first_rows=2), run)
    assert sorted(run.cancelled) == [0, 1]


async def test_bad_input_fails_before_anything_is_submitted() -> None:
    run = FakeRun()
    bad = dataclasses.replace(request(3), inputs={"x": np.zeros((3, 5), np.float32)})
    with pytest.raises(InvalidInput, match="shape"):
        await open_row_stream(config(), 1, bad, run)
    with pytest.raises(InvalidInput, match="chunks"):
        await open_row_stream(config(1), 1, request(5000), run)
    assert run.calls == []


async def test_a_failing_chunk_ends_the_stream_and_cancels_what_follows() -> None:
    run = FakeRun()
    stream = await open_row_stream(config(), 1, request(20, first_rows=2), run)
    run.answers[0].set_result(None)
    run.answers[1].set_exception(ModelError("boom"))
    assert (await anext(stream)).span == RowSpan(0, 2)
    with pytest.raises(ModelError, match="boom"):
        await anext(stream)
    await asyncio.sleep(0)
    assert sorted(run.cancelled) == [2, 3]
    assert [c async for c in stream] == []


async def test_a_model_without_batching_is_one_chunk() -> None:
    run = FakeRun()
    stream = await open_row_stream(config(0), 1, request(3), run)
    run.answers[0].set_result(None)
    [chunk] = [c async for c in stream]
    assert chunk.span == RowSpan(0, 1) and chunk.final and len(run.calls) == 1


def test_rows_event_is_one_v2_response_on_one_data_line() -> None:
    outputs = {"y": np.array([[1.0, 2.0]], np.float32), "z": np.array([[3]], np.int32)}
    event = encode_rows_event("m", "1", "r", outputs, (RequestedOutput("y", False),),
                              row_offset=4, num_rows=1, final=True)  # fmt: skip
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    payload = json.loads(event.removeprefix(b"data: "))
    assert payload["parameters"] == {"row_offset": 4, "num_rows": 1, "final": True}
    assert payload["outputs"] == [
        {"name": "y", "datatype": "FP32", "shape": [1, 2], "data": [1.0, 2.0]}
    ]
    with pytest.raises(InvalidInput, match="unknown output"):
        encode_rows_event("m", "1", None, outputs, (RequestedOutput("w", False),),
                          row_offset=0, num_rows=1, final=True)  # fmt: skip
    error = json.loads(encode_error_event("late", 504).removeprefix(b"data: "))
    assert error == {"error": "late", "code": 504}


def test_binary_outputs_are_refused_for_a_stream() -> None:
    check_json_outputs(request(1))
    binary = dataclasses.replace(request(1), outputs=(RequestedOutput("y", True),))
    with pytest.raises(InvalidInput, match="JSON tensors only"):
        check_json_outputs(binary)

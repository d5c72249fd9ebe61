"""Streamed rows of one v2 request (`/infer_stream`): its rows split into a small first chunk and
chunks of up to max_batch_size, all submitted at once so they batch with other traffic, and
handed back in row order as each completes; closing the stream cancels what has not run."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec

from fulcrum.batcher import InferResult
from fulcrum.config import ModelConfig
from fulcrum.errors import InvalidInput
from fulcrum.protocol import InferRequest, validate_inputs
from fulcrum.types import TensorMap

Run = Callable[[TensorMap], Awaitable[InferResult]]
DEFAULT_FIRST_ROWS = 8  # capped at max_batch_size
# A stream holds one task and one queued request per chunk: bounded, like the body itself.
MAX_NUM_CHUNKS = 4096


@dataclass(frozen=True, slots=True)
class ChunkSizes:
    """How a streamed request is cut: the first chunk's rows, then chunks of `chunk_rows`."""

    first_rows: int
    chunk_rows: int


@dataclass(frozen=True, slots=True)
class RowSpan:
    """Rows [row_offset, row_offset + num_rows) of the request."""

    row_offset: int
    num_rows: int


@dataclass(frozen=True, slots=True)
class RowChunk:
    """One completed chunk: which rows, their result, and whether it is the last."""

    span: RowSpan
    result: InferResult
    final: bool


def chunk_sizes(parameters: dict[str, object], max_batch_size: int) -> ChunkSizes:
    """Sizes from the request's `first_rows` / `chunk_rows` parameters; by default
    min(8, max_batch_size) and max_batch_size. Each must lie in 1..max_batch_size."""
    first_rows = _rows_parameter(parameters, "first_rows", min(DEFAULT_FIRST_ROWS, max_batch_size),
                                 max_batch_size)  # fmt: skip
    chunk_rows = _rows_parameter(parameters, "chunk_rows", max_batch_size, max_batch_size)
    return ChunkSizes(first_rows, chunk_rows)


def _rows_parameter(
    parameters: dict[str, object], key: str, default: int, max_batch_size: int
) -> int:
    value = parameters.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= max_batch_size:
        raise InvalidInput(
            f"parameter {key!r} must be an integer in 1..{max_batch_size} (max_batch_size), "
            f"got {value!r}"
        )
    return value


def plan_spans(num_rows: int, sizes: ChunkSizes) -> list[RowSpan]:
    """The chunks of `num_rows` rows, in order: `first_rows`, then `chunk_rows` at a time."""
    spans = [RowSpan(0, min(sizes.first_rows, num_rows))]
    offset = spans[0].num_rows
    while offset < num_rows:
        size = min(sizes.chunk_rows, num_rows - offset)
        spans.append(RowSpan(offset, size))
        offset += size
    return spans


class RowStream:
    """The chunks of one request, in row order, each as soon as it and those before it are done.

    A failed chunk raises its error from `__anext__` and cancels the chunks after it; `aclose`
    cancels whatever is still queued (a queued chunk then never runs)."""

    def __init__(self, version: int, spans: list[RowSpan], tasks: list[asyncio.Task[InferResult]]):
        self.version = version
        self.route: str | None = None  # the `Fulcrum-Route` header (laned models only)
        self.spans = spans
        self.num_rows = sum(span.num_rows for span in spans)
        self._tasks = tasks
        self._next = 0

    def __aiter__(self) -> RowStream:
        return self

    async def __anext__(self) -> RowChunk:
        index = self._next
        if index >= len(self._tasks):
            raise StopAsyncIteration
        self._next += 1
        try:
            result = await self._tasks[index]
        except BaseException:
            self._next = len(self._tasks)  # the stream ends with this error
            self.cancel()
            raise
        return RowChunk(self.spans[index], result, final=index == len(self._tasks) - 1)

    def cancel(self) -> None:
        """Cancel every chunk not done yet: queued ones never run, running ones are dropped."""
        for task in self._tasks:
            task.cancel()

    async def aclose(self) -> None:
        """Cancel what is left and wait until every chunk has settled."""
        self._next = len(self._tasks)
        self.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def open_row_stream(
    config: ModelConfig, version: int, request: InferRequest, run: Run
) -> RowStream:
    """Validate the whole request, submit every chunk through `run`, and return the stream once
    each chunk is queued. Bad input, or a chunk refused on admission (full queue, deadline
    passed), raises here, before any row is sent; later errors come out of the stream."""
    if config.max_batch_size > 0:
        spans, chunks = _split(config, request)
    else:  # no batch axis: the request is one inference, answered in one chunk
        spans, chunks = [RowSpan(0, 1)], [request.inputs]
    tasks = [asyncio.ensure_future(run(chunk)) for chunk in chunks]
    for task in tasks:
        task.add_done_callback(_retrieve)
    stream = RowStream(version, spans, tasks)
    try:
        # One yield lets each task run up to its first wait: validated and admitted to the
        # queue, or failed (a full queue raises synchronously in submit).
        await asyncio.sleep(0)
    except BaseException:
        stream.cancel()
        raise
    refused = next((t for t in tasks if t.done() and not t.cancelled() and t.exception()), None)
    if refused is not None:
        await stream.aclose()
        error = refused.exception()
        assert error is not None
        raise error
    return stream


def _split(config: ModelConfig, request: InferRequest) -> tuple[list[RowSpan], list[TensorMap]]:
    # Validated as a whole (any number of rows) so a bad row is a 400 before the stream starts;
    # each chunk is validated again on submit, like any request.
    unbounded = msgspec.structs.replace(config, max_batch_size=sys.maxsize)
    inputs = validate_inputs(unbounded, request.inputs)
    first = next(iter(inputs.values()), None)
    if first is None:
        raise InvalidInput("request has no inputs, so no rows to stream")
    num_rows = int(first.shape[0])
    spans = plan_spans(num_rows, chunk_sizes(request.parameters, config.max_batch_size))
    if len(spans) > MAX_NUM_CHUNKS:
        raise InvalidInput(
            f"{num_rows} rows make {len(spans)} chunks; a stream takes at most {MAX_NUM_CHUNKS} "
            "(raise 'chunk_rows' or send fewer rows)"
        )
    chunks = [
        {name: arr[s.row_offset : s.row_offset + s.num_rows] for name, arr in inputs.items()}
        for s in spans
    ]
    return spans, chunks


def _retrieve(task: asyncio.Task[InferResult]) -> None:
    """Mark a chunk's error as seen: a stream closed early still fails no one loudly."""
    if not task.cancelled():
        task.exception()

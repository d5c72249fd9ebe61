"""The KServe v2 target: reads the model's metadata, prebuilds infer requests, sends them
(to `/infer`, or to `/infer_stream` with `stream_rows`: see `loadgen/row_stream.py`)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np

from fulcrum.client import ClientError, Connection, Endpoint, build_request, get_json
from fulcrum.errors import InvalidInput
from fulcrum.loadgen.inputs import (
    LengthDist,
    ModelMeta,
    num_rows_of,
    read_jsonl,
    synthetic_inputs,
    tensors_from_row,
)
from fulcrum.loadgen.records import Outcome
from fulcrum.types import TensorMap


class V2Inputs(msgspec.Struct, frozen=True, kw_only=True):
    """How to build the requests of a KServe v2 run."""

    batch_size: int = 1  # rows per request
    lengths: LengthDist = LengthDist(16, 16)
    input_file: Path | None = None
    num_distinct: int = 16  # distinct synthetic bodies, reused round-robin
    binary: bool = False  # the binary-tensor extension instead of JSON tensors
    stream_rows: bool = False  # POST to /infer_stream: rows come back as events (JSON outputs)
    seed: int = 0


class PreparedRequest(msgspec.Struct, frozen=True):
    """One request ready to send: its raw HTTP bytes and how many rows it carries."""

    raw: bytes
    num_rows: int


async def fetch_metadata(endpoint: Endpoint, model: str) -> ModelMeta:
    """`GET /v2/models/{model}`, validated into what the builder needs."""
    try:
        return msgspec.convert(await get_json(endpoint, f"/v2/models/{model}"), ModelMeta)
    except msgspec.ValidationError as exc:
        raise ClientError(f"model '{model}' metadata is not KServe v2: {exc}") from exc


def _post(
    endpoint: Endpoint, model: str, body: bytes, headers: dict[str, str], *, stream: bool = False
) -> bytes:
    headers = {"Content-Type": "application/json", **headers}
    path = f"/v2/models/{model}/infer"
    if stream:
        headers["Accept"] = "text/event-stream"
        path += "_stream"
    return build_request(endpoint, "POST", path, headers=headers, body=body)


def encode_request(
    endpoint: Endpoint, model: str, tensors: TensorMap, *, binary: bool, stream: bool = False
) -> bytes:
    """Raw HTTP bytes of one infer request (body encoded by `fulcrum.protocol`); a streamed one
    may send binary inputs but asks for JSON outputs, all a stream carries."""
    from fulcrum.protocol import encode_infer_request

    parameters: dict[str, object] = {"binary_data_output": False} if stream else {}
    body, headers = encode_infer_request(tensors, binary=binary, parameters=parameters)
    return _post(endpoint, model, body, headers, stream=stream)


class _BodyInput(msgspec.Struct):
    shape: list[int]


class _Body(msgspec.Struct):
    inputs: list[_BodyInput]


def _from_row(
    endpoint: Endpoint, meta: ModelMeta, row: dict[str, object], inputs: V2Inputs
) -> PreparedRequest:
    if isinstance(row.get("inputs"), list):
        # A complete v2 request body: sent as written, with its own batch size.
        try:
            body = msgspec.convert(row, _Body)
        except msgspec.ValidationError as exc:
            raise InvalidInput(f"JSONL v2 request: {exc}") from exc
        batched = bool(meta.inputs) and bool(meta.inputs[0].shape) and meta.inputs[0].shape[0] < 0
        first = body.inputs[0].shape if body.inputs else []
        num_rows = first[0] if batched and first else 1
        raw = _post(endpoint, meta.name, msgspec.json.encode(row), {}, stream=inputs.stream_rows)
        return PreparedRequest(raw, num_rows)
    tensors = tensors_from_row(meta, row, inputs.batch_size)
    raw = encode_request(
        endpoint, meta.name, tensors, binary=inputs.binary, stream=inputs.stream_rows
    )
    return PreparedRequest(raw, num_rows_of(meta, tensors))


def prepare_v2(endpoint: Endpoint, meta: ModelMeta, inputs: V2Inputs) -> list[PreparedRequest]:
    """The requests a run cycles through: one per JSONL row, or `num_distinct` synthetic ones.

    A JSONL row is either a complete v2 body (`{"inputs": [...]}`) or `{input_name: value}`,
    repeated `batch_size` times along the batch axis.
    """
    if inputs.batch_size < 1:
        raise InvalidInput(f"batch size must be >= 1, got {inputs.batch_size}")
    if inputs.input_file is not None:
        return [_from_row(endpoint, meta, row, inputs) for row in read_jsonl(inputs.input_file)]
    rng = np.random.default_rng(inputs.seed)
    requests = []
    for _ in range(max(1, inputs.num_distinct)):
        tensors = synthetic_inputs(
            meta, num_rows=inputs.batch_size, lengths=inputs.lengths, rng=rng
        )
        raw = encode_request(
            endpoint, meta.name, tensors, binary=inputs.binary, stream=inputs.stream_rows
        )
        requests.append(PreparedRequest(raw, num_rows_of(meta, tensors)))
    return requests


class V2Target:
    """Hands out slots that send the prepared requests round-robin."""

    def __init__(self, endpoint: Endpoint, requests: list[PreparedRequest]) -> None:
        if not requests:
            raise InvalidInput("no requests to send")
        self.endpoint = endpoint
        self.requests = requests
        self.num_sent = 0
        self.num_retried = 0  # sent again after the server's idle close crossed them (client.py)

    def open_slot(self) -> V2Slot:
        return V2Slot(self)


class V2Slot:
    """One keep-alive connection sending infer requests."""

    def __init__(self, target: V2Target) -> None:
        self.target = target
        self.connection = Connection(target.endpoint)

    async def send(self, timeout_s: float) -> Outcome:
        target = self.target
        request = target.requests[target.num_sent % len(target.requests)]
        target.num_sent += 1
        retried = self.connection.num_retried
        try:
            # An inference is safe to repeat: it changes nothing on the server.
            response = await self.connection.request(
                request.raw, timeout_s=timeout_s, retry_unanswered=True
            )
        finally:
            target.num_retried += self.connection.num_retried - retried
        if not 200 <= response.status < 300:
            return Outcome(response.status, request.num_rows, error=response.body[:200].decode())
        timing = response.server_timing_ms()
        return Outcome(
            response.status,
            request.num_rows,
            timing.get("queue"),
            timing.get("compute"),
            timing.get("batch"),
            timing.get("total"),
        )

    def close(self) -> None:
        self.connection.close()

"""Cached values as bytes: a batch model's result (its tensors) or a generation (text, tokens).
Decoding is strict and never executes anything (msgpack into typed structs, no pickle): a value
that is corrupt, foreign, of an older format or stored under another key is a miss (None)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from fulcrum.batcher import InferResult
from fulcrum.types import Array, TensorMap

MAGIC = b"FCv1"
MAX_RANK = 32
# Plain numbers only: an object, void or datetime dtype from a stored value is never built.
_NUMERIC_KINDS = frozenset("biufc")


class _Tensor(msgspec.Struct, array_like=True, frozen=True):
    name: str
    dtype: str  # numpy dtype string ("<f4"); "bytes" for a BYTES tensor
    shape: list[int]
    data: bytes  # raw little-endian elements; empty for BYTES
    items: list[bytes] = []  # a BYTES tensor's elements, in C order


class _Result(msgspec.Struct, array_like=True, frozen=True, tag="r"):
    key: bytes
    compute_s: float
    tensors: list[_Tensor]


class _Generation(msgspec.Struct, array_like=True, frozen=True, tag="g"):
    key: bytes
    compute_s: float
    texts: list[str]
    token_ids: list[list[int]]
    finish_reason: str
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class CachedGeneration:
    """A finished generation as the LLM exact tier keeps it: the text and tokens of each step
    as the engine streamed them, so a hit streams back in the same pieces."""

    texts: list[str]
    token_ids: list[list[int]]  # one list per piece of `texts`
    finish_reason: str  # "stop" or "length": nothing else is cached
    prompt_tokens: int
    compute_s: float  # how long it took to generate: the time a hit saves


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Result | _Generation)


def encode_result(key: bytes, result: InferResult) -> bytes:
    """A batch model's outputs, with the key they answer (checked on decode)."""
    tensors = [_encode_tensor(name, arr) for name, arr in result.outputs.items()]
    return MAGIC + _encoder.encode(_Result(key, result.compute_s, tensors))


def decode_result(key: bytes, value: bytes) -> tuple[InferResult, float] | None:
    """The result and the compute time it saves; None for anything but a valid value of `key`."""
    decoded = _decode(value)
    if not isinstance(decoded, _Result) or decoded.key != key:
        return None
    outputs: TensorMap = {}
    for tensor in decoded.tensors:
        arr = _decode_tensor(tensor)
        if arr is None or tensor.name in outputs:
            return None
        outputs[tensor.name] = arr
    # A hit spent no time queued or computing: Server-Timing then says so.
    return InferResult(outputs, 0.0, 0.0, 0), decoded.compute_s


def encode_generation(key: bytes, generation: CachedGeneration) -> bytes:
    g = generation
    value = _Generation(key, g.compute_s, g.texts, g.token_ids, g.finish_reason, g.prompt_tokens)
    return MAGIC + _encoder.encode(value)


def decode_generation(key: bytes, value: bytes) -> CachedGeneration | None:
    decoded = _decode(value)
    if not isinstance(decoded, _Generation) or decoded.key != key:
        return None
    d = decoded
    if d.finish_reason not in ("stop", "length") or d.prompt_tokens < 0:
        return None
    if len(d.texts) != len(d.token_ids) or not d.texts:
        return None
    return CachedGeneration(d.texts, d.token_ids, d.finish_reason, d.prompt_tokens, d.compute_s)


def _decode(value: bytes) -> _Result | _Generation | None:
    if not value.startswith(MAGIC):
        return None
    try:
        return _decoder.decode(memoryview(value)[len(MAGIC) :])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _encode_tensor(name: str, arr: Array) -> _Tensor:
    shape = [int(d) for d in arr.shape]
    if arr.dtype.kind == "O":
        items = [bytes(x) if isinstance(x, bytes | bytearray) else str(x).encode()
                 for x in arr.ravel().tolist()]  # fmt: skip
        return _Tensor(name, "bytes", shape, b"", items)
    little = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    return _Tensor(name, little.dtype.str, shape, np.ascontiguousarray(little).tobytes())


def _decode_tensor(tensor: _Tensor) -> Array | None:
    shape = tensor.shape
    if len(shape) > MAX_RANK or any(d < 0 for d in shape):
        return None
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if tensor.dtype == "bytes":
        if len(tensor.items) != count or tensor.data:
            return None
        out = np.empty(count, dtype=object)
        out[:] = tensor.items
        return out.reshape(shape)
    try:
        dtype = np.dtype(tensor.dtype)
    except (TypeError, ValueError):
        return None
    if dtype.kind not in _NUMERIC_KINDS or count * dtype.itemsize != len(tensor.data):
        return None
    # A copy the caller owns and may write to (frombuffer alone would be read-only).
    return np.frombuffer(tensor.data, dtype=dtype).astype(dtype.newbyteorder("=")).reshape(shape)

"""Request inputs: synthetic text, token ids or tensors shaped by the model's metadata, or JSONL.

Bodies are built and encoded once before a run; the run cycles through them, so the client
spends no CPU on encoding while it measures.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np

from fulcrum.datatypes import to_numpy
from fulcrum.errors import InvalidInput
from fulcrum.types import TensorMap

_TEXT = (
    "the quick brown fox jumps over a lazy dog while latency and throughput trade places "
    "in every serving system batch queue model request token answer fast slow"
)
_WORDS = tuple(_TEXT.split())


class TensorMeta(msgspec.Struct, frozen=True):
    """One input as the server's metadata describes it (shape includes the batch axis)."""

    name: str
    datatype: str
    shape: list[int]


class ModelMeta(msgspec.Struct, frozen=True):
    """The parts of `GET /v2/models/{m}` the request builder reads."""

    name: str
    inputs: list[TensorMeta]
    outputs: list[TensorMeta] = []
    platform: str = ""


class LengthDist(msgspec.Struct, frozen=True):
    """Sequence length (words or tokens): fixed `N`, uniform `A-B`, or normal `MEAN:STD`."""

    low: int
    high: int
    std: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        try:
            if "-" in text:
                low, high = (int(x) for x in text.split("-", 1))
                dist = cls(low, high)
            elif ":" in text:
                mean, std = text.split(":", 1)
                dist = cls(int(mean), int(mean), float(std))
            else:
                dist = cls(int(text), int(text))
        except ValueError:
            raise InvalidInput(f"bad length {text!r}: use N, A-B or MEAN:STD") from None
        if dist.low < 1 or dist.high < dist.low or dist.std < 0:
            raise InvalidInput(f"bad length {text!r}: lengths must be >= 1 and A <= B")
        return dist

    def sample(self, rng: np.random.Generator) -> int:
        if self.std > 0:
            return max(1, round(rng.normal(self.low, self.std)))
        return int(rng.integers(self.low, self.high + 1))


def synthetic_text(num_words: int, rng: np.random.Generator) -> str:
    """`num_words` words from a small fixed vocabulary."""
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), num_words))


def _tensor(
    meta: TensorMeta, num_rows: int, length: int, vocab_size: int, rng: np.random.Generator
) -> np.ndarray:
    # Leading -1 is the batch axis; any other -1 is a sequence axis of this request's length.
    dims = [num_rows] + [length if d < 0 else d for d in meta.shape[1:]]
    if not meta.shape or meta.shape[0] >= 0:
        dims = [length if d < 0 else d for d in meta.shape]
    if meta.datatype == "BYTES":
        words = [synthetic_text(length, rng).encode() for _ in range(int(np.prod(dims)))]
        return np.array(words, dtype=np.object_).reshape(dims)
    dtype = to_numpy(meta.datatype)
    lowered = meta.name.lower()
    if dtype.kind in "iu":
        if "mask" in lowered:
            return np.ones(dims, dtype=dtype)
        if "type" in lowered:
            return np.zeros(dims, dtype=dtype)
        return rng.integers(0, vocab_size, dims).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, dims).astype(dtype)
    return rng.standard_normal(dims).astype(dtype)


def synthetic_inputs(
    meta: ModelMeta,
    *,
    num_rows: int,
    lengths: LengthDist,
    rng: np.random.Generator,
    vocab_size: int = 1000,
) -> TensorMap:
    """One request's tensors, every input filled to match the metadata (shared length)."""
    if not meta.inputs:
        raise InvalidInput(f"model '{meta.name}' declares no inputs; give --input-file")
    length = lengths.sample(rng)
    return {t.name: _tensor(t, num_rows, length, vocab_size, rng) for t in meta.inputs}


def read_jsonl(path: Path) -> list[dict[str, object]]:
    """One JSON object per non-empty line."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise InvalidInput(f"cannot read {path}: {exc.strerror}") from exc
    rows: list[dict[str, object]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = msgspec.json.decode(line)
        except msgspec.DecodeError as exc:
            raise InvalidInput(f"{path}:{number}: not JSON: {exc}") from exc
        if not isinstance(row, dict):
            raise InvalidInput(f"{path}:{number}: expected a JSON object")
        rows.append(row)
    if not rows:
        raise InvalidInput(f"{path}: no requests")
    return rows


def tensors_from_row(meta: ModelMeta, row: dict[str, object], num_rows: int) -> TensorMap:
    """A JSONL row `{input_name: value, ...}` as tensors with `num_rows` copies of the value."""
    tensors: TensorMap = {}
    for spec in meta.inputs:
        if spec.name not in row:
            continue
        dtype = to_numpy(spec.datatype)
        value = row[spec.name]
        if dtype == np.object_:
            items = value if isinstance(value, list) else [value]
            one = np.array([str(v).encode() for v in items], dtype=np.object_)
        else:
            one = np.asarray(value, dtype=dtype)
        batched = bool(spec.shape) and spec.shape[0] < 0
        row_shape = spec.shape[1:] if batched else spec.shape
        if all(d >= 0 for d in row_shape) and one.size == int(np.prod(row_shape)):
            one = one.reshape(row_shape)  # e.g. a JSON string for a per-row scalar
        tensors[spec.name] = np.stack([one] * num_rows) if batched else one
    if not tensors:
        names = [t.name for t in meta.inputs]
        raise InvalidInput(f"JSONL row names none of the model's inputs {names}: {row}")
    return tensors


def num_rows_of(meta: ModelMeta, tensors: TensorMap) -> int:
    """Rows in a request: the batch axis length when the model batches, else 1."""
    for spec in meta.inputs:
        array = tensors.get(spec.name)
        if array is not None and spec.shape and spec.shape[0] < 0 and array.ndim:
            return int(array.shape[0])
    return 1

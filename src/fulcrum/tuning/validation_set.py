"""The rows a quantized variant is checked (and calibrated) on: read from `--validation FILE`
(JSONL, one object per row mapping input names to values, optional "label"), or generated from
the config's inputs: varied sentences for a text model, seeded random tensors otherwise."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fulcrum.config import ModelConfig, TensorSpec
from fulcrum.datatypes import to_numpy
from fulcrum.errors import InvalidInput
from fulcrum.types import Array, TensorMap

DEFAULT_NUM_ROWS = 64
LABEL_KEY = "label"
_DYNAMIC_DIM = 8  # the size a -1 dimension gets in generated tensors

_SUBJECTS = (
    "The server", "A small model", "Our team", "The new release", "This query", "My neighbour",
    "The river", "A patient reader", "The city council", "Every request", "The old library",
)  # fmt: skip
_VERBS = (
    "answers", "describes", "measures", "ignores", "improves", "follows", "explains", "reaches",
    "sorts", "translates", "remembers", "carries",
)  # fmt: skip
_OBJECTS = (
    "the question", "a long list of documents", "the latency budget", "several warm evenings",
    "the quiet street by the harbour", "every batch of sentences", "the price of fresh bread",
    "an unexpected error", "the morning train to the coast", "the results of the survey",
)  # fmt: skip
_TAILS = (
    "before noon", "without a single mistake", "because the weather changed",
    "while the queue kept growing", "and then it started to rain", "in under a second",
    "as the documentation suggests", "although nobody asked for it",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ValidationSet:
    """Rows as one batch per input (axis 0 is the row), their labels, and where they came from."""

    inputs: TensorMap
    labels: tuple[int, ...] | None
    source: str  # the file, or "generated"

    @property
    def num_rows(self) -> int:
        return len(next(iter(self.inputs.values()))) if self.inputs else 0


def load_validation(
    config: ModelConfig, path: Path | None, *, num_rows: int, seed: int = 0
) -> ValidationSet:
    """Read `path` when given, else generate `num_rows` rows for `config`'s inputs."""
    if path is not None:
        return read_validation(config, path)
    return generate_validation(config, num_rows=num_rows, seed=seed)


def read_validation(config: ModelConfig, path: Path) -> ValidationSet:
    """Parse a JSONL validation file; InvalidInput names the file and line of a bad row."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InvalidInput(f"validation file {path}: cannot read: {exc.strerror}") from exc
    specs = {spec.name: spec for spec in config.inputs}
    columns: dict[str, list[object]] = {}
    labels: list[int] = []
    num_rows = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        row = _parse_line(path, number, line)
        where = f"{path} line {number}"
        _check_keys(where, row, specs, has_label_so_far=bool(labels), num_rows=num_rows)
        if LABEL_KEY in row:
            labels.append(_label(where, row.pop(LABEL_KEY)))
        for name, value in row.items():
            columns.setdefault(name, []).append(value)
        num_rows += 1
    if num_rows == 0:
        raise InvalidInput(f"validation file {path}: no rows")
    inputs = {
        name: _column(path, name, values, specs.get(name)) for name, values in columns.items()
    }
    return ValidationSet(inputs, tuple(labels) if labels else None, str(path))


def _parse_line(path: Path, number: int, line: str) -> dict[str, object]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{path} line {number}: not valid JSON ({exc.msg})") from exc
    if not isinstance(row, dict):
        raise InvalidInput(f"{path} line {number}: expected a JSON object of input values")
    return row


def _check_keys(
    where: str,
    row: dict[str, object],
    specs: dict[str, TensorSpec],
    *,
    has_label_so_far: bool,
    num_rows: int,
) -> None:
    names = set(row) - {LABEL_KEY}
    if specs:
        unknown = sorted(names - set(specs))
        missing = sorted(n for n, s in specs.items() if n not in names and not s.optional)
        if unknown or missing:
            raise InvalidInput(
                f"{where}: inputs {sorted(names)} do not match the model's "
                f"(unknown {unknown}, missing {missing})"
            )
    if num_rows and (LABEL_KEY in row) != has_label_so_far:
        raise InvalidInput(f"{where}: every row or none must have a {LABEL_KEY!r}")


def _label(where: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{where}: {LABEL_KEY!r} must be a class index (an integer)")
    return value


def _column(path: Path, name: str, values: list[object], spec: TensorSpec | None) -> Array:
    datatype = spec.datatype if spec is not None else _guess_datatype(values[0])
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in values):
            raise InvalidInput(f"validation file {path}: input {name!r} must be text on every row")
        return np.array(values, dtype=np.object_).reshape(len(values), 1)  # (N, 1)
    try:
        return np.asarray(values, dtype=to_numpy(datatype))  # (N, *shape)
    except (ValueError, TypeError) as exc:
        raise InvalidInput(
            f"validation file {path}: input {name!r}: rows are not {datatype} tensors of one "
            f"shape ({exc})"
        ) from exc


def _guess_datatype(value: object) -> str:
    if isinstance(value, str):
        return "BYTES"
    flat = np.asarray(value)
    return "INT64" if flat.dtype.kind in "iu" else "FP32"


def generate_validation(config: ModelConfig, *, num_rows: int, seed: int = 0) -> ValidationSet:
    """Seeded rows for every declared input: sentences of several lengths for text, small
    normal floats, small non-negative integers (safe as indices) and coin flips otherwise."""
    if not config.inputs:
        raise InvalidInput(
            f"model {config.name!r} declares no [[inputs]] to generate rows for; "
            "give --validation FILE"
        )
    rng = np.random.default_rng(seed)
    inputs = {spec.name: _generate(spec, num_rows, rng) for spec in config.inputs}
    return ValidationSet(inputs, None, "generated")


def _generate(spec: TensorSpec, num_rows: int, rng: np.random.Generator) -> Array:
    if spec.datatype == "BYTES":
        texts = [sentence(rng) for _ in range(num_rows)]
        return np.array(texts, dtype=np.object_).reshape(num_rows, 1)  # (N, 1)
    shape = (num_rows, *(_DYNAMIC_DIM if d < 0 else d for d in spec.shape))
    dtype = to_numpy(spec.datatype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 10, shape).astype(dtype)
    return rng.integers(0, 2, shape).astype(np.bool_)


def sentence(rng: np.random.Generator) -> str:
    """One sentence of one to four clauses: short ones and long ones, as real traffic has."""
    clauses = []
    for _ in range(int(rng.integers(1, 5))):
        parts = [_SUBJECTS, _VERBS, _OBJECTS, _TAILS]
        clauses.append(" ".join(str(p[int(rng.integers(0, len(p)))]) for p in parts))
    return ", and ".join(clauses) + "."

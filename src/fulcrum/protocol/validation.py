"""Check a decoded request against its model's config before it is queued, and put its tensors
in the config's shape, so a bad request fails alone and equal requests batch together."""

from __future__ import annotations

from fulcrum.config import ModelConfig, TensorSpec
from fulcrum.datatypes import from_numpy
from fulcrum.errors import InvalidInput
from fulcrum.protocol.request import RequestedOutput
from fulcrum.types import Array, TensorMap


def validate_inputs(config: ModelConfig, inputs: TensorMap) -> TensorMap:
    """Check names, datatypes, shapes and content of `inputs` against `config`; the error names
    the fault. Returns the inputs in the config's canonical shape (rows, *spec.shape): a row of
    one element sent without its axis ([N] for [N, 1]) gets it, so it batches with the rest."""
    specs = {spec.name: spec for spec in config.inputs}
    for name in inputs:
        if name not in specs:
            raise InvalidInput(
                f"unknown input {name!r}; model {config.name!r} takes {sorted(specs)}"
            )
    canonical: TensorMap = {}
    for spec in config.inputs:
        arr = inputs.get(spec.name)
        if arr is None:
            if not spec.optional:
                raise InvalidInput(f"missing input {spec.name!r} of model {config.name!r}")
            continue
        _check_datatype(config.name, spec, arr)
        if config.max_batch_size > 0:
            arr = _canonical_batched(spec, arr, config.max_batch_size)
        elif not _shape_matches(arr.shape, spec.shape):
            raise InvalidInput(
                f"input {spec.name!r}: shape {list(arr.shape)}, expected {list(spec.shape)}"
            )
        canonical[spec.name] = arr
    if config.max_batch_size > 0:
        num_rows = {name: int(arr.shape[0]) for name, arr in canonical.items()}
        if len(set(num_rows.values())) > 1:
            raise InvalidInput(f"inputs disagree on the number of rows (axis 0): {num_rows}")
    validate_content(config, canonical)
    return canonical


def validate_content(config: ModelConfig, inputs: TensorMap) -> None:
    """Per-request checks of values that would otherwise fail a whole batch in the backend:
    the rows of the text input that the model's tokenizer decodes must be UTF-8 text.
    (Integers out of range for their datatype are refused when the body is decoded.)"""
    if config.tokenizer is None:
        return
    texts = inputs.get(config.tokenizer.input)
    if texts is not None:
        check_text_rows(config.tokenizer.input, texts)


def check_text_rows(name: str, texts: Array) -> None:
    """`texts` must be rows of UTF-8 text, shape [N] or [N, 1]; the error names the row."""
    rows = text_column(name, texts)
    for i, item in enumerate(rows.tolist()):
        if isinstance(item, str):
            continue
        if not isinstance(item, bytes | bytearray):
            raise InvalidInput(f"input {name!r} row {i}: expected text, got {type(item).__name__}")
        try:
            bytes(item).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"input {name!r} row {i}: not valid UTF-8 ({exc})") from None


def text_column(name: str, texts: Array) -> Array:
    """The rows of a text tensor of shape [N] or [N, 1], as shape [N]."""
    if texts.ndim == 2 and texts.shape[1] == 1:
        return texts[:, 0]
    if texts.ndim != 1:
        raise InvalidInput(
            f"input {name!r}: expected shape [N] or [N, 1] of text, got {list(texts.shape)}"
        )
    return texts


def _check_datatype(model: str, spec: TensorSpec, arr: Array) -> None:
    datatype = from_numpy(arr.dtype)
    if datatype == spec.datatype:
        return
    if datatype == "BYTES":
        raise InvalidInput(
            f"input {spec.name!r}: got text (BYTES), but model {model!r} takes a tensor of "
            f"{spec.datatype} numbers there"
        )
    raise InvalidInput(
        f"input {spec.name!r}: datatype {datatype}, but model {model!r} expects {spec.datatype}"
    )


def _canonical_batched(spec: TensorSpec, arr: Array, max_batch_size: int) -> Array:
    expected = ["rows", *spec.shape]
    if arr.ndim == 0:
        raise InvalidInput(f"input {spec.name!r}: a scalar, expected shape {expected}")
    num_rows = arr.shape[0]
    if num_rows > max_batch_size:
        raise InvalidInput(
            f"input {spec.name!r}: {num_rows} rows, more than max_batch_size {max_batch_size}"
        )
    if num_rows == 0:
        raise InvalidInput(f"input {spec.name!r}: 0 rows; a request needs at least one")
    row_shape = arr.shape[1:]
    if _shape_matches(row_shape, spec.shape):
        return arr
    # A row of one element may come without its axis ([N] for [N, 1]), as clients often send;
    # reshaped here, so it batches with (and concatenates onto) requests sent as [N, 1].
    if not row_shape and all(dim == 1 for dim in spec.shape):
        return arr.reshape((num_rows, *spec.shape))
    raise InvalidInput(f"input {spec.name!r}: shape {list(arr.shape)}, expected {expected}")


def _shape_matches(shape: tuple[int, ...], spec_shape: tuple[int, ...]) -> bool:
    return len(shape) == len(spec_shape) and all(
        want in (-1, got) for got, want in zip(shape, spec_shape, strict=True)
    )


def validate_requested_outputs(config: ModelConfig, requested: tuple[RequestedOutput, ...]) -> None:
    """Every requested output must be one the config declares (when it declares any)."""
    if not config.outputs:
        return
    names = {spec.name for spec in config.outputs}
    for out in requested:
        if out.name not in names:
            raise InvalidInput(
                f"unknown output {out.name!r}; model {config.name!r} has {sorted(names)}"
            )

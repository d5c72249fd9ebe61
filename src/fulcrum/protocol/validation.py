"""Check a decoded request against its model's config before it is queued."""

from __future__ import annotations

from fulcrum.config import ModelConfig, TensorSpec
from fulcrum.datatypes import from_numpy
from fulcrum.errors import InvalidInput
from fulcrum.protocol.request import RequestedOutput
from fulcrum.types import Array, TensorMap


def validate_inputs(config: ModelConfig, inputs: TensorMap) -> None:
    """Check names, datatypes and shapes of `inputs` against `config`; the error names the fault."""
    specs = {spec.name: spec for spec in config.inputs}
    for name in inputs:
        if name not in specs:
            raise InvalidInput(
                f"unknown input {name!r}; model {config.name!r} takes {sorted(specs)}"
            )
    num_rows: dict[str, int] = {}
    for spec in config.inputs:
        arr = inputs.get(spec.name)
        if arr is None:
            if not spec.optional:
                raise InvalidInput(f"missing input {spec.name!r} of model {config.name!r}")
            continue
        datatype = from_numpy(arr.dtype)
        if datatype != spec.datatype:
            raise InvalidInput(
                f"input {spec.name!r}: datatype {datatype}, but model {config.name!r} "
                f"expects {spec.datatype}"
            )
        if config.max_batch_size > 0:
            num_rows[spec.name] = _check_batched_shape(spec, arr, config.max_batch_size)
        elif not _shape_matches(arr.shape, spec.shape):
            raise InvalidInput(
                f"input {spec.name!r}: shape {list(arr.shape)}, expected {list(spec.shape)}"
            )
    if len(set(num_rows.values())) > 1:
        raise InvalidInput(f"inputs disagree on the number of rows (axis 0): {num_rows}")


def _check_batched_shape(spec: TensorSpec, arr: Array, max_batch_size: int) -> int:
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
    # A row of one element may come without its axis ([N] for [N, 1]), as clients often send.
    scalar_row_ok = not row_shape and all(dim == 1 for dim in spec.shape)
    if not scalar_row_ok and not _shape_matches(row_shape, spec.shape):
        raise InvalidInput(f"input {spec.name!r}: shape {list(arr.shape)}, expected {expected}")
    return int(num_rows)


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

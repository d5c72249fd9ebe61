"""Batch layout: count a request's rows, stack inputs on axis 0 (padding dynamic axes), split
outputs back by rows. Pure array code; which requests share a batch is `fulcrum.policy`'s call.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fulcrum.config import ModelConfig
from fulcrum.errors import InvalidInput, ModelError
from fulcrum.policy import dynamic_axes
from fulcrum.types import Array, TensorMap


class Collator:
    """Stacks one model's requests into a batch and splits the batch's outputs back."""

    def __init__(self, config: ModelConfig) -> None:
        self.dynamic_axes = dynamic_axes(config)
        self._pad_values = {spec.name: spec.pad_value for spec in config.inputs}
        self._name = config.name
        self._max_batch_size = config.max_batch_size

    def count_rows(self, inputs: TensorMap) -> int:
        """A request's rows (axis 0, equal for every input), or InvalidInput before it queues."""
        num_rows = -1
        for name, array in inputs.items():
            if array.ndim == 0:
                raise InvalidInput(f"input {name!r} is a scalar; it needs a batch axis")
            if num_rows < 0:
                num_rows = array.shape[0]
            elif array.shape[0] != num_rows:
                raise InvalidInput(
                    f"input {name!r} has {array.shape[0]} rows; other inputs have {num_rows}"
                )
        if num_rows < 1:
            raise InvalidInput("request has no rows")
        if num_rows > self._max_batch_size:
            raise InvalidInput(
                f"request has {num_rows} rows; model {self._name!r} takes at most "
                f"{self._max_batch_size} (max_batch_size)"
            )
        return num_rows

    def stack(self, inputs: Sequence[TensorMap]) -> TensorMap:
        """One batch from the requests' inputs, in order; one request passes through as is."""
        if len(inputs) == 1:
            return inputs[0]
        return {name: self._concat(name, [one[name] for one in inputs]) for name in inputs[0]}

    def split(self, outputs: TensorMap, row_counts: Sequence[int]) -> list[TensorMap]:
        """Each request's own rows of `outputs`; ModelError when an output has the wrong rows."""
        if len(row_counts) == 1:
            return [outputs]  # a model without batching has no batch axis to check
        num_rows = sum(row_counts)
        for name, array in outputs.items():
            if array.ndim == 0 or array.shape[0] != num_rows:
                rows = array.shape[0] if array.ndim else "no"
                raise ModelError(f"output {name!r} has {rows} rows; the batch had {num_rows}")
        parts: list[TensorMap] = []
        start = 0
        for count in row_counts:
            end = start + count
            parts.append({name: array[start:end] for name, array in outputs.items()})
            start = end
        return parts

    def _concat(self, name: str, arrays: list[Array]) -> Array:
        if name in self.dynamic_axes:
            row_shapes = {a.shape[1:] for a in arrays}
            if len(row_shapes) > 1:
                return _pad_concat(arrays, self._pad_values.get(name, 0.0))
        return np.concatenate(arrays, axis=0)


def _pad_concat(arrays: list[Array], pad_value: float) -> Array:
    """Concatenate on axis 0, padding every other axis to the batch's longest with `pad_value`."""
    row_shape = tuple(max(sizes) for sizes in zip(*(a.shape[1:] for a in arrays), strict=True))
    num_rows = sum(a.shape[0] for a in arrays)
    out = np.full((num_rows, *row_shape), pad_value, dtype=arrays[0].dtype)
    start = 0
    for array in arrays:
        end = start + array.shape[0]
        out[(slice(start, end), *(slice(0, d) for d in array.shape[1:]))] = array
        start = end
    return out

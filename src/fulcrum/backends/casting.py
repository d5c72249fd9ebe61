"""Width-only dtype conversion of request tensors to what a model takes (INT32 ids -> INT64)."""

from __future__ import annotations

import numpy as np

from fulcrum.errors import InvalidInput
from fulcrum.types import Array


def cast_to(name: str, array: Array, dtype: np.dtype[np.generic]) -> Array:
    """`array` as `dtype` when they differ only in width (INT32 -> INT64); else InvalidInput."""
    if array.dtype == dtype:
        return array
    same_kind = array.dtype.kind == dtype.kind or {array.dtype.kind, dtype.kind} <= {"O", "S", "U"}
    if not same_kind:
        raise InvalidInput(f"input {name!r}: datatype {array.dtype} cannot be fed as {dtype}")
    if dtype.kind in "iu" and array.size and array.dtype.itemsize > dtype.itemsize:
        # Narrowing: refuse values that would wrap around rather than corrupt them.
        info = np.iinfo(dtype)  # type: ignore[type-var]
        if int(array.min()) < info.min or int(array.max()) > info.max:
            raise InvalidInput(f"input {name!r}: values out of range for {dtype}")
    try:
        return array.astype(dtype)
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"input {name!r}: cannot convert to {dtype}: {exc}") from exc

"""KServe v2 datatype names and their numpy equivalents."""

from __future__ import annotations

import numpy as np

from fulcrum.errors import InvalidInput

_V2_TO_NUMPY: dict[str, np.dtype[np.generic]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}
_NUMPY_TO_V2 = {dt: name for name, dt in _V2_TO_NUMPY.items()}
DATATYPES = frozenset(_V2_TO_NUMPY)


def to_numpy(datatype: str) -> np.dtype[np.generic]:
    """The numpy dtype of a v2 datatype; BYTES is an object array of `bytes`."""
    try:
        return _V2_TO_NUMPY[datatype]
    except KeyError:
        raise InvalidInput(
            f"unknown datatype {datatype!r}; expected one of {sorted(DATATYPES)}"
        ) from None


def from_numpy(dtype: np.dtype[np.generic]) -> str:
    """The v2 datatype of a numpy dtype (strings and bytes map to BYTES)."""
    if dtype.kind in ("O", "S", "U"):
        return "BYTES"
    try:
        return _NUMPY_TO_V2[np.dtype(dtype)]
    except KeyError:
        raise InvalidInput(f"numpy dtype {dtype} has no v2 datatype") from None

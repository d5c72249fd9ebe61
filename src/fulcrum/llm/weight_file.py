"""A safetensors file read tensor by tensor into memory the model already owns. The header (an
8-byte little-endian length, then JSON) is parsed here and each tensor's bytes are read from the
file straight into its destination: a load holds no second copy of the weights. (safetensors'
own reader maps the file, and every page it touches counts to the process until it closes.)"""

from __future__ import annotations

import ctypes
import io
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from fulcrum.errors import ConfigError

# safetensors dtype names -> torch dtypes (the ones a checkpoint this engine reads can hold).
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
_METADATA = "__metadata__"


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor lies in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    num_bytes: int


class WeightFile:
    """An open safetensors file: `names`, `entry`, and reads into given or new tensors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._file = io.FileIO(path, "rb")
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc}") from exc
        try:
            self._entries, self.metadata = self._read_header()
        except BaseException:
            self._file.close()
            raise

    def __enter__(self) -> WeightFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def names(self) -> list[str]:
        """The tensors' names, in the order the file stores them."""
        return list(self._entries)

    def entry(self, key: str) -> TensorEntry:
        return self._entries[key]

    def read(self, key: str) -> torch.Tensor:
        """A new CPU tensor holding `key`."""
        entry = self._entries[key]
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self.read_into(key, out)
        return out

    def read_into(self, key: str, out: torch.Tensor) -> None:
        """Fill `out` (a contiguous CPU tensor of the entry's dtype and size) with `key`."""
        entry = self._entries[key]
        if out.dtype != entry.dtype or out.numel() * out.element_size() != entry.num_bytes:
            raise ValueError(f"{key}: read into {out.dtype} {list(out.shape)}")
        if not (out.is_contiguous() and out.device.type == "cpu"):
            raise ValueError(f"{key}: read into a non-contiguous or non-CPU tensor")
        if entry.num_bytes == 0:
            return
        # The tensor's own bytes as a writable buffer (ctypes, not numpy: importing numpy costs
        # an engine process ~70 MB of BLAS buffers it never uses).
        view = memoryview((ctypes.c_char * entry.num_bytes).from_address(out.data_ptr())).cast("B")
        self._file.seek(entry.offset)
        done = 0
        while done < entry.num_bytes:  # a read may return less than asked (2 GB per call)
            got = self._file.readinto(view[done:])
            if not got:
                raise ConfigError(f"{self.path}: truncated: tensor {key!r} ends past the file")
            done += got

    def _read_header(self) -> tuple[dict[str, TensorEntry], dict[str, str]]:
        if sys.byteorder != "little":  # files are little-endian; bytes are read as they lie
            raise ConfigError(f"{self.path}: safetensors files are read on little-endian hosts")
        prefix = self._file.read(8)
        size = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < size <= _MAX_HEADER_BYTES:
            raise ConfigError(f"{self.path}: not a safetensors file (header length {size})")
        try:
            header = json.loads(self._file.read(size))
        except ValueError as exc:
            raise ConfigError(f"{self.path}: not a safetensors file: {exc}") from exc
        if not isinstance(header, dict):
            raise ConfigError(f"{self.path}: not a safetensors file (header is not an object)")
        metadata = header.pop(_METADATA, None) or {}
        start = 8 + size
        entries = {key: self._entry(key, value, start) for key, value in header.items()}
        return dict(sorted(entries.items(), key=lambda kv: kv[1].offset)), metadata

    def _entry(self, key: str, value: object, start: int) -> TensorEntry:
        try:
            fields = value if isinstance(value, dict) else {}
            dtype = DTYPES[fields["dtype"]]
            shape = tuple(int(n) for n in fields["shape"])
            begin, end = (int(n) for n in fields["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{self.path}: tensor {key!r}: unreadable entry {value!r}") from exc
        num_bytes = math.prod(shape) * dtype.itemsize
        if end - begin != num_bytes or begin < 0:
            raise ConfigError(
                f"{self.path}: tensor {key!r} of shape {list(shape)} spans {end - begin} bytes"
            )
        return TensorEntry(dtype, shape, start + begin, num_bytes)

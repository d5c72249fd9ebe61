"""Tensors through shared memory between the server and a model's process.

Numeric arrays are copied into a shared segment and only their name, dtype, shape and offset go
over the pipe; object (BYTES) arrays have no flat layout, so they travel pickled with the message.
The server creates, grows and unlinks every segment; a model's process only attaches to them.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

from fulcrum.errors import ModelError
from fulcrum.types import Array, TensorMap

ALIGN_BYTES = 64  # each tensor starts on a cache line, so the copies in and out stay aligned
DEFAULT_REGION_BYTES = 1 << 20  # Triton python_backend's shm-default-byte-size (1 MB)
NAME_PREFIX = "fulcrum_"


@dataclass(frozen=True)
class TensorRef:
    """Where one numeric tensor lies in a segment."""

    name: str
    dtype: np.dtype[np.generic]
    shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class Layout:
    """A tensor map laid out for one segment: the refs, the pickled rest, the bytes it needs."""

    refs: tuple[TensorRef, ...]
    objects: dict[str, Array]
    num_bytes: int


def plan(tensors: Mapping[str, Array]) -> Layout:
    """Lay `tensors` out one after another, each aligned to `ALIGN_BYTES`."""
    refs: list[TensorRef] = []
    objects: dict[str, Array] = {}
    offset = 0
    for name, array in tensors.items():
        if array.dtype.hasobject:
            objects[name] = array
            continue
        refs.append(TensorRef(name, array.dtype, tuple(array.shape), offset))
        offset += -(-array.nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return Layout(tuple(refs), objects, offset)


def write(buf: memoryview, layout: Layout, tensors: Mapping[str, Array]) -> None:
    """Copy the numeric tensors of `layout` into `buf` (which holds `layout.num_bytes`)."""
    for ref in layout.refs:
        view = np.ndarray(ref.shape, ref.dtype, buffer=buf, offset=ref.offset)
        view[...] = tensors[ref.name]  # handles non-contiguous sources
        del view  # a live view would keep the segment from closing


def read(buf: memoryview, layout: Layout) -> TensorMap:
    """Copies of the tensors of `layout` out of `buf`, plus its pickled ones.

    Copies, not views: the segment is rewritten by the next batch, and a view would also keep
    the segment from closing.
    """
    tensors: TensorMap = {}
    for ref in layout.refs:
        view = np.ndarray(ref.shape, ref.dtype, buffer=buf, offset=ref.offset)
        tensors[ref.name] = view.copy()
        del view
    tensors.update(layout.objects)
    return tensors


class Region:
    """A segment the server owns: grown on demand (never shrunk), unlinked on `close`."""

    def __init__(self, num_bytes: int = DEFAULT_REGION_BYTES) -> None:
        self._segment = _create(num_bytes)

    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def buf(self) -> memoryview:
        buf = self._segment.buf
        assert buf is not None, "region used after close"
        return buf

    @property
    def size(self) -> int:
        return self._segment.size

    def ensure(self, num_bytes: int) -> None:
        """Make the region hold at least `num_bytes` (a new, larger segment when it is short)."""
        if num_bytes <= self._segment.size:
            return
        grown = _create(max(num_bytes, 2 * self._segment.size))
        # The old segment's name is gone at once; a process still mapping it keeps its pages
        # until it attaches to the new name.
        _release(self._segment)
        self._segment = grown

    def close(self) -> None:
        _release(self._segment)


class Attachments:
    """A model process's view of the server's segments, by name; stale ones are closed."""

    def __init__(self) -> None:
        self._segments: dict[str, shared_memory.SharedMemory] = {}

    def get(self, name: str) -> memoryview:
        segment = self._segments.get(name)
        if segment is None:
            segment = self._segments[name] = shared_memory.SharedMemory(name=name)
        buf = segment.buf
        assert buf is not None
        return buf

    def keep_only(self, names: Iterable[str]) -> None:
        """Close the attachments to segments the server has replaced."""
        wanted = set(names)
        for name in [n for n in self._segments if n not in wanted]:
            self._segments.pop(name).close()

    def close(self) -> None:
        self.keep_only(())


def _create(num_bytes: int) -> shared_memory.SharedMemory:
    name = NAME_PREFIX + secrets.token_hex(8)  # 24 characters: within macOS's limit of 31
    size = max(1, num_bytes)
    try:
        segment = shared_memory.SharedMemory(name=name, create=True, size=size)
    except OSError as exc:  # it unlinks what it created
        raise _no_room(size, exc) from exc
    fd = getattr(segment, "_fd", -1)
    if fd >= 0 and hasattr(os, "posix_fallocate"):
        # Reserve the pages now: on a full /dev/shm (Docker's default is 64 MB) a write to an
        # unreserved page is a SIGBUS that kills the server; here it fails one batch.
        try:
            os.posix_fallocate(fd, 0, segment.size)
        except OSError as exc:
            _release(segment)
            raise _no_room(size, exc) from exc
    return segment


def _no_room(num_bytes: int, exc: OSError) -> ModelError:
    return ModelError(
        f"no room for {num_bytes} bytes of shared memory ({exc.strerror}); "
        "give /dev/shm more (docker run --shm-size)"
    )


def _release(segment: shared_memory.SharedMemory) -> None:
    segment.close()
    segment.unlink()

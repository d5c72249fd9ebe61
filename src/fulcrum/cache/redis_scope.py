"""This process's copy of one Redis vector-index scope: the tail of the scope's Redis list,
decoded, kept in step by fetching only what was appended since, and searched with numpy."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import msgspec
import numpy as np
import numpy.typing as npt

from fulcrum.cache.protocols import SemanticEntry

F32 = npt.NDArray[np.float32]
Record = tuple[bytes, bytes, str]  # (float32 vector bytes, exact-tier key, text)
_BAD = SemanticEntry(text="", key=b"")
_NO_ROW: F32 = np.zeros(0, np.float32)


def encode_record(row: F32, entry: SemanticEntry) -> bytes:
    return msgspec.msgpack.encode((row.tobytes(), entry.key, entry.text))


def decode_records(items: list[bytes]) -> tuple[list[F32], list[SemanticEntry]]:
    """Rows and entries of Redis list items; an item that does not decode keeps its place as a
    row of width 0 (never matched), so places still match the Redis list."""
    rows: list[F32] = []
    entries: list[SemanticEntry] = []
    decoder = msgspec.msgpack.Decoder(Record)
    for item in items:
        record: Record | None = None
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            record = decoder.decode(item)
        if record is None or len(record[0]) % 4:
            rows.append(_NO_ROW)
            entries.append(_BAD)
        else:
            rows.append(np.frombuffer(record[0], dtype=np.float32))
            entries.append(SemanticEntry(text=record[2], key=record[1]))
    return rows, entries


@dataclass(slots=True)
class ScopeCopy:
    """Rows i of the copy are the last len(rows) items of the scope's Redis list; `epoch` and
    `num_added` say which state of the list that is (the epoch changes when the list is made
    anew, e.g. after a Redis restart, so an incremental fetch is never applied to another list).
    The matrix searched is kept in step with appends and trims instead of rebuilt from rows."""

    fetched_at: float
    epoch: bytes = b""
    num_added: int = 0
    rows: list[F32] = field(default_factory=list)
    entries: list[SemanticEntry] = field(default_factory=list)
    _width: int = -1  # the width `_matrix` holds; -1: not built
    _matrix: F32 = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # (M, D)
    _positions: npt.NDArray[np.intp] = field(default_factory=lambda: np.zeros(0, np.intp))

    def append(self, rows: list[F32], entries: list[SemanticEntry]) -> None:
        base = len(self.rows)
        self.rows.extend(rows)
        self.entries.extend(entries)
        if self._width < 0:
            return
        chosen = [i for i, row in enumerate(rows) if row.shape[0] == self._width]
        if chosen:
            added = np.stack([rows[i] for i in chosen])  # (A, D)
            self._matrix = np.concatenate((self._matrix, added))
            offsets = np.asarray(chosen, dtype=np.intp) + base
            self._positions = np.concatenate((self._positions, offsets))

    def keep_last(self, num_rows: int) -> None:
        """Drop the oldest rows (trimmed from Redis) so that `num_rows` remain."""
        excess = len(self.rows) - num_rows
        if excess <= 0:
            return
        del self.rows[:excess], self.entries[:excess]
        if self._width >= 0:  # positions ascend: the rows kept are a suffix of the matrix
            start = int(np.searchsorted(self._positions, excess))
            self._matrix = self._matrix[start:]
            self._positions = self._positions[start:] - excess

    def search(self, query: F32, k: int) -> list[tuple[float, SemanticEntry]]:
        """The k rows nearest `query` (D,) by inner product, best first; rows of another width
        (an embedder changed under the same scope) are never candidates."""
        if query.shape[0] != self._width:
            self._build(query.shape[0])
        if k < 1 or self._matrix.shape[0] == 0:
            return []
        similarities = self._matrix @ query  # (M,)
        k = min(k, similarities.shape[0])
        top = np.argpartition(-similarities, k - 1)[:k]
        top = top[np.argsort(-similarities[top], kind="stable")]
        return [(float(similarities[i]), self.entries[self._positions[i]]) for i in top]

    def _build(self, width: int) -> None:
        places = [i for i, row in enumerate(self.rows) if row.shape[0] == width and width]
        self._positions = np.asarray(places, dtype=np.intp)
        rows = [self.rows[i] for i in places]
        self._matrix = np.stack(rows) if rows else np.zeros((0, width), np.float32)
        self._width = width

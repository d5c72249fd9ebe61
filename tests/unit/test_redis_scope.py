"""A Redis index scope's local copy: decoding, trimming to Redis's tail, and search."""

from __future__ import annotations

import numpy as np

from fulcrum.cache.protocols import SemanticEntry
from fulcrum.cache.redis_scope import ScopeCopy, decode_records, encode_record


def record(name: str, *values: float) -> bytes:
    row = np.asarray(values, dtype=np.float32)
    return encode_record(row / np.linalg.norm(row), SemanticEntry(text=name, key=name.encode()))


def query(*values: float) -> np.ndarray:
    row = np.asarray(values, dtype=np.float32)
    return row / np.linalg.norm(row)


def test_search_is_best_first_and_bounded_by_k() -> None:
    copy = ScopeCopy(fetched_at=0.0)
    copy.append(*decode_records([record("x", 1, 0), record("y", 0, 1), record("xy", 1, 1)]))
    found = copy.search(query(1, 0.2), k=2)
    assert [e.text for _, e in found] == ["x", "xy"]
    assert found[0][1] == SemanticEntry(text="x", key=b"x")
    assert found[0][0] > found[1][0]
    assert copy.search(query(1, 0), k=0) == []


def test_keep_last_drops_the_oldest_rows_and_the_search_follows() -> None:
    copy = ScopeCopy(fetched_at=0.0)
    copy.append(*decode_records([record("a", 1, 0), record("b", 0, 1)]))
    assert [e.text for _, e in copy.search(query(1, 0), k=1)] == ["a"]
    copy.keep_last(1)
    assert [e.text for _, e in copy.search(query(1, 0), k=5)] == ["b"]
    copy.keep_last(5)  # more than it has: nothing changes
    assert len(copy.rows) == 1


def test_rows_of_another_width_and_bad_records_keep_their_place_but_never_match() -> None:
    copy = ScopeCopy(fetched_at=0.0)
    copy.append(*decode_records([record("wide", 1, 0, 0), b"\xc1bad", record("narrow", 1, 0)]))
    assert len(copy.rows) == 3  # places match Redis's list, so keep_last stays right
    assert [e.text for _, e in copy.search(query(1, 0), k=5)] == ["narrow"]
    assert [e.text for _, e in copy.search(query(1, 0, 0), k=5)] == ["wide"]
    assert copy.search(query(1, 0, 0, 0), k=5) == []


def test_matrix_follows_appends_and_trims_without_a_rebuild() -> None:
    copy = ScopeCopy(fetched_at=0.0)
    copy.append(*decode_records([record("a", 1, 0), record("b", 0, 1)]))
    assert [e.text for _, e in copy.search(query(1, 0), k=1)] == ["a"]  # built: width 2
    copy.append(*decode_records([record("c", 1, 0.1), record("wide", 1, 0, 0)]))
    copy.keep_last(3)  # a goes
    found = copy.search(query(1, 0), k=5)
    assert [e.text for _, e in found] == ["c", "b"]
    fresh = ScopeCopy(fetched_at=0.0)  # the same rows built from scratch agree
    fresh.append(list(copy.rows), list(copy.entries))
    assert fresh.search(query(1, 0), k=5) == found

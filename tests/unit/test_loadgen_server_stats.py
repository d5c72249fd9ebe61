"""The server-side split from two Triton statistics snapshots."""

from __future__ import annotations

import pytest

from fulcrum.loadgen.server_stats import ServerSplit, parse_stats, split


def stats_body(num_requests: int, queue_ms: float, compute_ms: float, batches: dict[int, int]):  # type: ignore[no-untyped-def]
    num_executions = sum(batches.values())
    return {
        "model_stats": [
            {
                "name": "m",
                "version": "1",
                "inference_count": num_requests,
                "execution_count": num_executions,
                "inference_stats": {
                    "success": {"count": num_requests, "ns": 1},
                    "queue": {"count": num_requests, "ns": int(num_requests * queue_ms * 1e6)},
                    "compute_infer": {
                        "count": num_requests,
                        "ns": int(num_requests * compute_ms * 1e6),
                    },
                },
                "batch_stats": [
                    {"batch_size": size, "compute_infer": {"count": count, "ns": 0}}
                    for size, count in batches.items()
                ],
            }
        ]
    }


def test_split_is_the_delta_between_snapshots() -> None:
    before = parse_stats(stats_body(100, 1.0, 2.0, {1: 100}))
    after = parse_stats(stats_body(500, 2.0, 3.0, {1: 100, 4: 100}))
    got = split(before, after)
    # 400 new requests: queue total 1000-100 ms, compute 1500-200 ms; 100 new batches of 4.
    assert got.queue_ms == pytest.approx(900 / 400)
    assert got.compute_ms == pytest.approx(1300 / 400)
    assert got.mean_batch_size == pytest.approx(4.0)
    assert got.num_executions == 100


def test_no_statistics_means_no_split() -> None:
    assert split(None, parse_stats({"model_stats": []})) == ServerSplit()
    empty = parse_stats({"model_stats": []})
    assert split(empty, empty).queue_ms is None

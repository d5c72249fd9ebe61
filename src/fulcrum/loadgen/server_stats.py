"""The server's own view of a point: Triton-style statistics before and after, as a delta."""

from __future__ import annotations

import msgspec

from fulcrum.client import ClientError, Endpoint, get_json


class ServerSplit(msgspec.Struct, frozen=True, kw_only=True):
    """Mean queue and compute time per request and rows per execution, from the stats API."""

    queue_ms: float | None = None
    compute_ms: float | None = None
    mean_batch_size: float | None = None
    num_executions: int = 0


class _Duration(msgspec.Struct, frozen=True):
    count: int = 0
    ns: int = 0


class _InferenceStats(msgspec.Struct, frozen=True):
    queue: _Duration = _Duration()
    compute_infer: _Duration = _Duration()


class _BatchStat(msgspec.Struct):
    batch_size: int
    compute_infer: _Duration = _Duration()


class _ModelStat(msgspec.Struct):
    inference_count: int = 0
    execution_count: int = 0
    inference_stats: _InferenceStats = _InferenceStats()
    batch_stats: list[_BatchStat] = []


class StatsSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """Cumulative counters summed over a model's versions."""

    queue_count: int = 0
    queue_ns: int = 0
    compute_count: int = 0
    compute_ns: int = 0
    num_executions: int = 0
    num_rows: int = 0  # rows over all executions, from the batch statistics


class _StatsBody(msgspec.Struct):
    model_stats: list[_ModelStat] = []


def parse_stats(body: object) -> StatsSnapshot:
    """Sum a Triton statistics response over its entries."""
    stats = msgspec.convert(body, _StatsBody).model_stats
    return StatsSnapshot(
        queue_count=sum(s.inference_stats.queue.count for s in stats),
        queue_ns=sum(s.inference_stats.queue.ns for s in stats),
        compute_count=sum(s.inference_stats.compute_infer.count for s in stats),
        compute_ns=sum(s.inference_stats.compute_infer.ns for s in stats),
        num_executions=sum(s.execution_count for s in stats),
        num_rows=sum(b.batch_size * b.compute_infer.count for s in stats for b in s.batch_stats),
    )


async def snapshot(endpoint: Endpoint, model: str) -> StatsSnapshot | None:
    """The model's statistics now, or None when the server offers none."""
    try:
        return parse_stats(await get_json(endpoint, f"/v2/models/{model}/stats"))
    except (ClientError, msgspec.ValidationError):
        return None


def split(before: StatsSnapshot | None, after: StatsSnapshot | None) -> ServerSplit:
    """What the server did between two snapshots."""
    if before is None or after is None:
        return ServerSplit()
    num_queued = after.queue_count - before.queue_count
    num_computed = after.compute_count - before.compute_count
    num_executions = after.num_executions - before.num_executions
    num_rows = after.num_rows - before.num_rows
    return ServerSplit(
        queue_ms=(after.queue_ns - before.queue_ns) / num_queued / 1e6 if num_queued else None,
        compute_ms=(
            (after.compute_ns - before.compute_ns) / num_computed / 1e6 if num_computed else None
        ),
        mean_batch_size=num_rows / num_executions if num_executions and num_rows else None,
        num_executions=num_executions,
    )

"""Triton-style model statistics: cumulative counts and nanoseconds per model version."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field


def to_ns(seconds: float) -> int:
    """Seconds as whole nanoseconds; every duration in the statistics is rounded this one way,
    so a sum of requests' own timings (each through `to_ns`) equals the reported total."""
    return round(seconds * 1e9)


@dataclass
class Duration:
    """A count and a cumulative duration, as Triton reports them."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += to_ns(seconds)

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class ModelStats:
    """What `GET /v2/models/{m}/versions/{v}/stats` reports for one version.

    Follows the definitions of Triton's statistics extension (docs/protocol/
    extension_statistics.md) and how Triton's core aggregates them (`InferenceStatsAggregator`):

    - `inference_count`: "Each inference in a batched request is counted as an individual
      inference": the rows of every successful request, not the requests.
    - `execution_count`: "the number of successful inference executions": batches run, however
      many requests each held.
    - `inference_stats.success` / `fail`: one count and the request's whole duration per request.
    - `inference_stats.queue` / `compute_infer`: per successful request, cumulative: each request
      of a batch adds the time it waited and its batch's whole compute duration, so
      `compute_infer.ns / compute_infer.count` is the compute a request sat through.
    - `batch_stats`: per batch size, one count and that batch's compute duration per execution.
    """

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    batches: defaultdict[int, Duration] = field(default_factory=lambda: defaultdict(Duration))
    # Beyond Triton: the batch policy's state (fitted model, batch limit, queue bound) and the
    # requests refused with 503 before they ran, by reason ("queue_full", "deadline").
    policy_state: Callable[[], dict[str, object]] | None = None
    shed: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Beyond Triton: per backend with a `spin_when_idle` session, which session lone batches
    # take (measured medians, runs, how sparse runs are).
    lone_states: Callable[[], list[dict[str, object]]] | None = None
    # Triton's response cache statistics: a hit's lookup time; a miss's lookup and insert time.
    cache_hit: Duration = field(default_factory=Duration)
    cache_miss: Duration = field(default_factory=Duration)

    def record_success(
        self, num_rows: int, total_s: float, queue_s: float, compute_s: float
    ) -> None:
        """One request answered: `compute_s` is the run time of the batch that held it."""
        self.success.add(total_s)
        self.queue.add(queue_s)
        self.compute_infer.add(compute_s)
        self.inference_count += num_rows
        self._touch()

    def record_cache_hit(self, num_rows: int, total_s: float, cache_s: float) -> None:
        """A request answered by the result cache: a success (its rows counted, as Triton
        does) that neither queued nor computed."""
        self.success.add(total_s)
        self.cache_hit.add(cache_s)
        self.inference_count += num_rows
        self._touch()

    def record_failure(self, total_s: float) -> None:
        """One request that got an error (Triton records only its count and duration)."""
        self.fail.add(total_s)
        self._touch()

    def record_execution(self, batch_size: int, compute_s: float) -> None:
        """One batch that ran successfully; `batch_size` is its number of rows."""
        self.execution_count += 1
        self.batches[batch_size].add(compute_s)

    def _touch(self) -> None:
        self.last_inference_ms = int(time.time() * 1000)  # wall clock: a timestamp, not timing

    def to_json(self, name: str, version: int, variant: str = "default") -> dict[str, object]:
        row = self._triton_json(name, version, variant)
        if self.policy_state is not None:
            row["policy"] = {**self.policy_state(), "shed": dict(sorted(self.shed.items()))}
        lone = self.lone_states() if self.lone_states is not None else []
        if lone:
            row["lone_session"] = lone
        return row

    def _triton_json(self, name: str, version: int, variant: str) -> dict[str, object]:
        zero = Duration().to_json()
        return {
            "name": name,
            "version": str(version),
            "variant": variant,  # beyond Triton's fields: one row per loaded variant
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.to_json(),
                "fail": self.fail.to_json(),
                "queue": self.queue.to_json(),
                "compute_input": zero,
                "compute_infer": self.compute_infer.to_json(),
                "compute_output": zero,
                "cache_hit": self.cache_hit.to_json(),
                "cache_miss": self.cache_miss.to_json(),
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": zero,
                    "compute_infer": d.to_json(),
                    "compute_output": zero,
                }
                for size, d in sorted(self.batches.items())
            ],
        }


@dataclass
class LifecycleStats:
    """Beyond Triton: a model's scale-to-zero record, kept while it is unloaded (a new version's
    `ModelStats` start from zero; these do not)."""

    cold_start: Duration = field(default_factory=Duration)  # loads a request waited for
    cold_start_failures: int = 0
    idle_unloads: int = 0
    evictions: int = 0  # unloaded to fit another model in the memory budget
    memory_bytes: int = 0  # measured at the last load

    def to_json(self) -> dict[str, object]:
        return {
            "cold_start": self.cold_start.to_json(),
            "cold_start_failures": self.cold_start_failures,
            "idle_unloads": self.idle_unloads,
            "evictions": self.evictions,
            "memory_bytes": self.memory_bytes,
        }

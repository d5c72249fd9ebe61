"""Triton-style model statistics: cumulative counts and nanoseconds per model version."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Duration:
    """A count and a cumulative duration, as Triton reports them."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class ModelStats:
    """What `GET /v2/models/{m}/versions/{v}/stats` reports for one version."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    batches: defaultdict[int, Duration] = field(default_factory=lambda: defaultdict(Duration))

    def record_request(self, ok: bool, total_s: float, queue_s: float = 0.0) -> None:
        (self.success if ok else self.fail).add(total_s)
        if ok:
            self.queue.add(queue_s)
            self.inference_count += 1
        self.last_inference_ms = int(time.time() * 1000)  # wall clock: a timestamp, not timing

    def record_batch(self, batch_size: int, compute_s: float, num_requests: int) -> None:
        self.execution_count += 1
        self.compute_infer.add(compute_s, num_requests)
        self.batches[batch_size].add(compute_s)

    def to_json(self, name: str, version: int) -> dict[str, object]:
        zero = Duration().to_json()
        return {
            "name": name,
            "version": str(version),
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
                "cache_hit": zero,
                "cache_miss": zero,
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

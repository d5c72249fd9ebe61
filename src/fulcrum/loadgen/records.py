"""What the generator records per request: scheduled, sent and finished times, outcome, timings.

Times are `time.perf_counter()` seconds. Latency runs from the *scheduled* send time, so a
request that waited behind a stalled server or a late generator still counts its wait.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

# Pseudo status codes for failures that never got an HTTP status.
STATUS_CONNECT_ERROR = 0
STATUS_TIMEOUT = -1


@dataclass(slots=True)
class Outcome:
    """What one send returned: HTTP status and what the server said about its own time."""

    status: int
    num_rows: int = 1
    queue_ms: float | None = None
    compute_ms: float | None = None
    batch_size: float | None = None  # rows in the batch this request ran in (Server-Timing)
    total_ms: float | None = None  # the handler's own time, start to response built (Server-Timing)
    error: str = ""
    # LLM streams: when each output chunk arrived (perf_counter s) and output tokens.
    token_times_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


@dataclass(slots=True)
class RequestRecord:
    """One request as the generator saw it."""

    scheduled_s: float
    sent_s: float
    done_s: float
    outcome: Outcome

    @property
    def latency_s(self) -> float:
        return self.done_s - self.scheduled_s

    @property
    def lag_s(self) -> float:
        """How late the generator sent this request behind its own schedule."""
        return self.sent_s - self.scheduled_s

    @property
    def ttft_s(self) -> float | None:
        times = self.outcome.token_times_s
        return times[0] - self.scheduled_s if times else None

    @property
    def tpot_s(self) -> float | None:
        """vLLM's time per output token: (latency - TTFT) / (output tokens - 1)."""
        ttft_s = self.ttft_s
        num_tokens = self.outcome.num_output_tokens
        if ttft_s is None or num_tokens < 2:
            return None
        return (self.latency_s - ttft_s) / (num_tokens - 1)

    def itl_s(self) -> list[float]:
        """Inter-token latencies: gaps between successive output chunks."""
        times = self.outcome.token_times_s
        return [b - a for a, b in itertools.pairwise(times)]

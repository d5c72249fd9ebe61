"""A circuit breaker for a remote cache: after a few failures in a row, skip the backend for a
back-off that doubles while probes fail, then let one probe through. Pure: decisions take `now`."""

from __future__ import annotations

from dataclasses import dataclass

# The first back-off is short so a single lost packet costs little; the cap bounds how long a
# recovered Redis goes unused (and so how soon hits resume after a restart).
DEFAULT_MIN_BACKOFF_S = 0.1
DEFAULT_MAX_BACKOFF_S = 2.0
# One late answer on a busy machine (a GC pause, a descheduled thread) is not an outage: open
# only after this many failures in a row. A dead Redis reaches it within a few requests.
DEFAULT_FAILURE_THRESHOLD = 3


@dataclass(slots=True)
class CircuitBreaker:
    """Closed: every call goes through; `failure_threshold` failures in a row open it. Open:
    calls are skipped until `open_until`. Then one probe goes through (half-open); its success
    closes the breaker, its failure reopens it with twice the back-off."""

    min_backoff_s: float = DEFAULT_MIN_BACKOFF_S
    max_backoff_s: float = DEFAULT_MAX_BACKOFF_S
    failure_threshold: int = DEFAULT_FAILURE_THRESHOLD
    num_failures: int = 0  # in a row, while closed
    open_until: float | None = None  # None: closed
    backoff_s: float = 0.0
    probing: bool = False  # a probe is in flight: the others keep skipping
    num_opens: int = 0  # how many times it opened (a counter for tests and metrics)

    def allow(self, now: float) -> bool:
        """Whether a call may go to the backend now; a True while open starts the one probe."""
        if self.open_until is None:
            return True
        if self.probing or now < self.open_until:
            return False
        self.probing = True
        return True

    def success(self) -> None:
        self.open_until = None
        self.backoff_s = 0.0
        self.probing = False
        self.num_failures = 0

    def failure(self, now: float) -> None:
        # Calls that started while closed and fail after it opened do not stack back-offs:
        # only a failed probe doubles it.
        if self.open_until is not None and not self.probing:
            return
        if self.open_until is None:
            self.num_failures += 1
            if self.num_failures < self.failure_threshold:
                return
        self.backoff_s = min(self.max_backoff_s, max(self.min_backoff_s, 2 * self.backoff_s))
        self.open_until = now + self.backoff_s
        self.probing = False
        self.num_opens += 1

    def release_probe(self) -> None:
        """The probe ended without a verdict (its caller was cancelled): let another one go."""
        self.probing = False

    @property
    def is_open(self) -> bool:
        return self.open_until is not None

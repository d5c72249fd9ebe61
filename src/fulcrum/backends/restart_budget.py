"""How often a model's process may be restarted: a crash budget over a sliding window."""

from __future__ import annotations

from collections import deque

from fulcrum.types import Clock


class RestartBudget:
    """At most `max_restarts` crashes within any `window_s`; past that, no restart until the
    oldest of them leaves the window (so a model that crashes at once on load cannot spin)."""

    def __init__(self, max_restarts: int, window_s: float, clock: Clock) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._clock = clock
        self._crashes: deque[float] = deque()
        self.num_crashes = 0

    def record_crash(self) -> None:
        self._crashes.append(self._clock.now())
        self.num_crashes += 1

    def allows_restart(self) -> bool:
        return self._num_recent() <= self.max_restarts

    def retry_after_s(self) -> float:
        """Seconds until a restart is allowed again (0 when it is now)."""
        excess = self._num_recent() - self.max_restarts
        if excess <= 0:
            return 0.0
        return self._crashes[excess - 1] + self.window_s - self._clock.now()

    def _num_recent(self) -> int:
        now = self._clock.now()
        while self._crashes and now - self._crashes[0] >= self.window_s:
            self._crashes.popleft()
        return len(self._crashes)

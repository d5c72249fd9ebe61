"""When to restart a crashed LLM engine thread, as vLLM restarts its engine core: exponential
backoff that resets after a healthy period, and a bound on restarts per window after which the
engine stays down (and unhealthy) until the model is reloaded. Pure: it is told the time."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from fulcrum.errors import ConfigError


@dataclass(frozen=True)
class RestartPolicy:
    """Backoff and limits of engine restarts."""

    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    healthy_after_s: float = 60.0  # up this long since the last restart: backoff starts over
    max_restarts: int = 5  # restarts within window_s before the engine stays down
    window_s: float = 60.0

    def __post_init__(self) -> None:
        for key in ("initial_backoff_s", "max_backoff_s", "healthy_after_s", "window_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"restart policy {key} = {getattr(self, key)}: must be >= 0")
        if self.max_restarts < 0:
            raise ConfigError(f"restart policy max_restarts = {self.max_restarts}: must be >= 0")


class RestartTracker:
    """Crash history of one engine; `on_crash` says how long to wait before restarting."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.num_restarts = 0  # cumulative
        self._restarts_s: deque[float] = deque()  # restart times within the window
        self._num_backoffs = 0  # restarts since the engine was last healthy for a while
        self._last_restart_s: float | None = None

    def on_crash(self, now_s: float) -> float | None:
        """Seconds to wait before the next restart, or None: too many restarts, stay down."""
        policy = self.policy
        while self._restarts_s and now_s - self._restarts_s[0] >= policy.window_s:
            self._restarts_s.popleft()
        if len(self._restarts_s) >= policy.max_restarts:
            return None
        last = self._last_restart_s
        if last is not None and now_s - last >= policy.healthy_after_s:
            self._num_backoffs = 0
        doublings = min(self._num_backoffs, 64)  # 2.0**1100 would overflow; the cap is far lower
        backoff_s = min(policy.initial_backoff_s * 2.0**doublings, policy.max_backoff_s)
        self._num_backoffs += 1
        return backoff_s

    def on_restart(self, now_s: float) -> None:
        """Record a restart done at now_s."""
        self.num_restarts += 1
        self._restarts_s.append(now_s)
        self._last_restart_s = now_s

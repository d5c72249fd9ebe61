"""Shared value types: tensors by name and the clock every time-based decision is given."""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.generic]
TensorMap = dict[str, Array]


class Clock(Protocol):
    """Monotonic seconds; injected so policies are tested with a fake clock."""

    def now(self) -> float: ...


class MonotonicClock:
    """The real clock: `time.monotonic()`."""

    def now(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock that moves only when told; for tests of time-based policies."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, dt_s: float) -> None:
        self.t += dt_s

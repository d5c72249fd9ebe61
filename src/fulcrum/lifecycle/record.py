"""One model's record in the lifecycle: its use, its loads' memory figures and its wakes; it
outlives the model's loads."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fulcrum.stats import LifecycleStats


@dataclass
class ModelLife:
    """One model's use and load record; it outlives the model's loads."""

    last_used_s: float
    memory_bytes: int = 0  # measured at its last load (its processes': when last read)
    own_bytes: int = 0  # what its last load grew this process by
    wake: asyncio.Task[None] | None = None  # the cold start under way
    retry_at_s: float = 0.0  # no new cold start before this (after a failure)
    num_failures: int = 0  # failed cold starts in a row
    last_error: str = ""  # why the last cold start failed
    stats: LifecycleStats = field(default_factory=LifecycleStats)


def woken(life: ModelLife, task: asyncio.Task[None]) -> None:
    """A wake ended: the next one starts a new load."""
    life.wake = None
    if not task.cancelled():
        task.exception()  # its waiters have it; retrieved here for when none waits any more

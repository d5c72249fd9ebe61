"""Fakes for the lifecycle tests: a loader whose loads can be gated, broken, timed on a fake
clock and sized on a fake memory probe; a world that wires them to a `ModelLifecycle`."""

from __future__ import annotations

import asyncio
from pathlib import Path

from prometheus_client import CollectorRegistry

from fulcrum.config import ModelConfig
from fulcrum.errors import ConfigError
from fulcrum.lifecycle.manager import ModelLifecycle
from fulcrum.metrics import LifecycleMetrics
from fulcrum.types import FakeClock

MB = 1024 * 1024
ECHO = """
platform = "echo"
max_batch_size = 4
[[inputs]]
name = "x"
datatype = "FP32"
shape = [2]
[[outputs]]
name = "y"
datatype = "FP32"
shape = [2]
"""


class FakeServable:
    def __init__(self, config: ModelConfig, variant: str) -> None:
        self.config, self.variant = config, variant
        self.num_admitted = 0
        self.stopped = False
        self.stopped_event = asyncio.Event()

    @property
    def is_ready(self) -> bool:
        return not self.stopped

    async def stop(self) -> None:
        self.stopped = True
        self.stopped_event.set()


class FakeProbe:
    def __init__(self) -> None:
        self.bytes = 1000 * MB

    def used_bytes(self) -> int:
        return self.bytes


class FakeLoader:
    """Loads instantly unless gated; each load takes `load_s` on the fake clock and
    `size_mb[name]` (default 100) of the probe's memory; `broken` names fail."""

    def __init__(self, clock: FakeClock, probe: FakeProbe) -> None:
        self.clock, self.probe = clock, probe
        self.loads: list[FakeServable] = []
        self.size_mb: dict[str, int] = {}
        self.broken: set[str] = set()
        self.gate: asyncio.Event | None = None
        self.started = asyncio.Event()
        self.load_s = 0.0

    async def __call__(
        self, config: ModelConfig, version: int, path: Path, variant: str
    ) -> FakeServable:
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if config.name in self.broken:
            raise ConfigError(f"model '{config.name}' weights are broken")
        self.clock.advance(self.load_s)
        self.probe.bytes += self.size_mb.get(config.name, 100) * MB
        servable = FakeServable(config, variant)
        self.loads.append(servable)
        return servable

    def count(self, name: str) -> int:
        return sum(1 for s in self.loads if s.config.name == name)

    def last(self, name: str) -> FakeServable:
        return [s for s in self.loads if s.config.name == name][-1]


def make_model(
    root: Path,
    name: str,
    lifecycle: str = "idle_unload_s = 10",
    extra: str = "",
    *,
    weights_mb: int = 100,
) -> None:
    """An echo model with a (sparse: no disk used) weights file of `weights_mb`, the size the
    budget estimates for its first load."""
    (root / name / "1").mkdir(parents=True, exist_ok=True)
    (root / name / "config.toml").write_text(f"{ECHO}{extra}\n[lifecycle]\n{lifecycle}\n")
    with open(root / name / "1" / "weights.bin", "wb") as weights:
        weights.truncate(weights_mb * MB)


class World:
    def __init__(self, root: Path, budget_mb: int | None = None, *, real_clock: bool = False):
        self.clock = FakeClock(100.0)
        self.probe = FakeProbe()
        self.loader = FakeLoader(self.clock, self.probe)
        self.registry = CollectorRegistry()
        budget = None if budget_mb is None else budget_mb * MB
        self.life = ModelLifecycle(
            root, self.loader, LifecycleMetrics(self.registry),
            memory_budget_bytes=budget, clock=None if real_clock else self.clock,
            probe=self.probe,
        )  # fmt: skip
        self.repo = self.life.repository

    def metric(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def state(self, name: str) -> tuple[str, str]:
        row = next(r for r in self.repo.index() if r["name"] == name)
        return row["state"], row["reason"]


async def park(w: World, name: str = "a") -> None:
    w.clock.advance(1000.0)
    await w.life.sweep()
    assert w.repo.is_parked(name)

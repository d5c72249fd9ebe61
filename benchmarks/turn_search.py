"""The max-rate searches of `adaptive_vs_static.py --ends`, all servers' at once, their points in
turns: each server's bisection (`max_rate_under`) is its own, but only one point is measured at a
time, server after server, so a slow minute of the shared machine falls on every search alike
rather than on the one whose whole search it happened to overlap.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING

from fulcrum.client import Endpoint
from fulcrum.loadgen.bench import Bench, BenchOptions
from fulcrum.loadgen.kserve import V2Target
from fulcrum.loadgen.results import PointResult
from fulcrum.loadgen.search import max_rate_under
from fulcrum.loadgen.stats import Slo
from fulcrum.loadgen.windows import MeasurePlan

if TYPE_CHECKING:
    from adaptive_ends import Server


async def measure(server: Server, rate: float, seconds: float, slo: Slo, seed: int = 0
                  ) -> PointResult:  # fmt: skip
    """One open-loop Poisson point at `rate` against `server`, `seconds` long."""
    plan = MeasurePlan(warmup_s=1.0, window_s=seconds, max_duration_s=seconds, num_stable=1)
    options = BenchOptions(model="minilm", url=server.url, plan=plan, seed=seed, timeout_s=10.0)
    target = V2Target(Endpoint.from_url(server.url), server.requests)
    return await Bench(options, target, [slo]).point("rate", rate)


class Turns:
    """The servers' rate searches measure one point at a time, taking turns (round robin), so a
    slow spell of the shared machine falls on every server's search alike, not on the one whose
    whole search it happened to overlap. A finished search leaves the rotation."""

    def __init__(self, names: list[str]) -> None:
        self.order = list(names)
        self.current = 0  # index into order: whose point is next
        self.changed = asyncio.Condition()

    async def take(self, name: str) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.order[self.current] == name)

    async def pass_on(self, name: str, *, finished: bool = False) -> None:
        async with self.changed:
            position = self.order.index(name)
            if finished:
                self.order.pop(position)
                self.current -= position < self.current
            elif position == self.current:
                self.current += 1
            self.current = self.current % len(self.order) if self.order else 0
            self.changed.notify_all()


async def search(
    server: Server, turns: Turns, start_rate: float, seconds: float, slo: Slo, tolerance: float
) -> float | None:
    async def evaluate(rate: float) -> PointResult:
        await turns.take(server.name)
        try:
            p = await measure(server, rate, seconds, slo)
        finally:
            await turns.pass_on(server.name)
        print(f"    {server.name:34} search {rate:6.1f}/s P99 {p.latency.p99_ms:7.1f} ms "
              f"errors {p.errors} {'held' if p.slo_met else 'missed'}", flush=True)  # fmt: skip
        return p

    steps = 9 if tolerance >= 0.08 else 12  # a finer bracket takes a few more halvings
    try:
        found = await max_rate_under(evaluate, start_rate=start_rate, rel_tolerance=tolerance,
                                     max_steps=steps)  # fmt: skip
    finally:
        await turns.pass_on(server.name, finished=True)
    return found.best_rate


async def searches(
    all_servers: list[Server], start_rate: float, args: argparse.Namespace, slo: Slo, first: int
) -> list[float | None]:
    """Every server's search at once, their points in turns starting with server `first`."""
    rotated = all_servers[first:] + all_servers[:first]
    turns = Turns([s.name for s in rotated])
    found = await asyncio.gather(*(
        search(s, turns, start_rate, args.search_s, slo, args.search_tolerance) for s in rotated
    ))  # fmt: skip
    by_name = dict(zip([s.name for s in rotated], found, strict=True))
    return [by_name[s.name] for s in all_servers]

"""A load trace for benchmarks: steps of offered load (a fraction of measured capacity), Poisson
arrivals within each step, sent open loop by the load generator's dispatcher, summarised per step.

Shared by `adaptive_vs_static.py` (minilm, KServe v2) and `adaptive_llm.py` (tiny-llama, OpenAI
streams). Every policy replays the same arrival times (one seed), so steps compare request for
request. Latency runs from the scheduled send time, as everywhere in `fulcrum.loadgen`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
import msgspec
import numpy as np

from fulcrum.client import Endpoint
from fulcrum.loadgen import server_stats
from fulcrum.loadgen.driver import PerfTimer, PointHooks, Target, WindowLoop
from fulcrum.loadgen.open_loop import Dispatcher, OffsetSchedule
from fulcrum.loadgen.records import STATUS_TIMEOUT, RequestRecord
from fulcrum.loadgen.stats import Slo, percentile_ms
from fulcrum.loadgen.windows import Measurement, MeasurePlan

Good = Callable[[RequestRecord], bool]
WITHIN = 0.99  # a step holds its P99 SLO when this share of its requests is good


@dataclass(frozen=True, slots=True)
class Step:
    """One stretch of the trace: `load` x capacity requests/s for `duration_s`."""

    start_s: float  # offset from the trace's start
    duration_s: float
    load: float  # fraction of the measured capacity
    burst: bool = False

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


def ramp_trace(
    step_s: float,
    *,
    low: float = 0.1,
    peak: float = 1.5,
    num_levels: int = 8,
    burst_s: float = 1.0,
    burst_load: float = 2.0,
) -> list[Step]:
    """`low` up to `peak` and back down in `num_levels` levels each way, with a short burst at
    `burst_load` in the middle of the way up and of the way down (0 `burst_s`: no bursts)."""
    levels = [round(float(x), 3) for x in np.linspace(low, peak, num_levels)]
    shape = levels + levels[-2::-1]
    bursts = {num_levels // 2, num_levels + num_levels // 2} if burst_s > 0 else set()
    steps: list[Step] = []
    t = 0.0
    for i, load in enumerate(shape):
        if i in bursts:
            steps.append(Step(t, burst_s, burst_load, burst=True))
            t += burst_s
        steps.append(Step(t, step_s, load))
        t += step_s
    return steps


def arrival_times(steps: Sequence[Step], capacity_rps: float, seed: int) -> list[float]:
    """Offsets (s) of every send: Poisson at each step's rate, the same for every replay."""
    rng = np.random.default_rng(seed)
    times: list[float] = []
    for step in steps:
        rate = step.load * capacity_rps
        t = step.start_s + rng.exponential(1.0 / rate)
        while t < step.end_s:
            times.append(t)
            t += rng.exponential(1.0 / rate)
    return times


@dataclass
class Replayed:
    """What one replay produced: records, and the server's statistics at each step boundary."""

    start_s: float
    records: list[RequestRecord]
    snapshots: list[server_stats.StatsSnapshot | None] = field(default_factory=list)


async def replay(
    target: Target,
    steps: Sequence[Step],
    offsets: Sequence[float],
    *,
    url: str,
    model: str | None,
    timeout_s: float,
    max_in_flight: int = 1024,
) -> Replayed:
    """Send at `offsets` (open loop); snapshot `model`'s statistics at every step boundary."""
    timer = PerfTimer()
    end_s = steps[-1].end_s
    start_s = timer.now() + 0.05
    plan = MeasurePlan(warmup_s=0.0, window_s=end_s, max_duration_s=end_s)
    loop = WindowLoop(timer, Measurement(plan, start_s), PointHooks())  # holds `.completed`
    dispatcher = Dispatcher(target, timer, loop, max_in_flight)
    sender = asyncio.create_task(dispatcher.run(OffsetSchedule(offsets, start_s), timeout_s))
    snapshots: list[server_stats.StatsSnapshot | None] = []
    endpoint = Endpoint.from_url(url)
    try:
        for boundary in [0.0, *(s.end_s for s in steps)]:
            await timer.sleep_until(start_s + boundary)
            snapshots.append(await server_stats.snapshot(endpoint, model) if model else None)
        dispatcher.stopping = True
        sender.cancel()
        while dispatcher.tasks:  # requests in flight at the end still count
            await asyncio.gather(*dispatcher.tasks)
    finally:
        sender.cancel()
        dispatcher.close()
    return Replayed(start_s, loop.completed + dispatcher.drained, snapshots)


CAPACITY_LOADS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.4)


async def open_loop_capacity(
    target: Target,
    url: str,
    model: str,
    closed_rps: float,
    *,
    step_s: float = 4.0,
    within_s: float = 1.0,
) -> float:
    """The highest Poisson rate (req/s) the model sustains open loop, as overload and traces are
    sent: steps at CAPACITY_LOADS x the closed-loop rate, up to the first step that answers
    fewer than 99% of its requests within `within_s`. A closed loop overstates it: its clients
    wait for answers, so it never offers more than the server is finishing."""
    best = 0.0
    for load in CAPACITY_LOADS:
        steps = [Step(0.0, step_s, load)]
        offsets = arrival_times(steps, closed_rps, seed=7)
        run = await replay(target, steps, offsets, url=url, model=None, timeout_s=10.0)
        await settle(url, model)
        on_time = sum(1 for r in run.records if r.outcome.ok and r.latency_s <= within_s)
        share = on_time / max(1, len(run.records))
        print(f"  open loop {load * closed_rps:7.1f} req/s: {share:.1%} answered within "
              f"{within_s:g} s", flush=True)  # fmt: skip
        if share < 0.99:
            break
        best = load * closed_rps
    return best


@dataclass
class StepResult:
    """One step as a policy served it."""

    step: Step
    offered: int
    ok: int
    good: int  # answered within every SLO
    shed: int  # 503
    timed_out: int  # at the client
    other: int
    p99_ms: dict[str, float]  # per SLO metric, answered requests only (admitted P99)
    mean_batch: float | None


def print_steps(results: Sequence[PolicyResult], cell: Callable[[StepResult], str]) -> None:
    """A markdown table: a row per step, a column per policy."""
    print("| t s | load | " + " | ".join(r.name for r in results) + " |")
    print("|---:|---:|" + "---:|" * len(results))
    for i, first in enumerate(results[0].steps):
        step = first.step
        load = f"{step.load:.0%}{' burst' if step.burst else ''}"
        cells = " | ".join(cell(r.steps[i]) for r in results)
        print(f"| {step.start_s:.0f} | {load} | {cells} |")


def summarize_steps(
    run: Replayed, steps: Sequence[Step], slos: Sequence[Slo], good: Good
) -> list[StepResult]:
    """Assign requests to steps by scheduled time; per step counts, P99s and mean batch size."""
    by_step: list[list[RequestRecord]] = [[] for _ in steps]
    for record in run.records:
        offset = record.scheduled_s - run.start_s
        index = next((i for i, s in enumerate(steps) if offset < s.end_s), len(steps) - 1)
        by_step[index].append(record)
    results = []
    for i, (step, records) in enumerate(zip(steps, by_step, strict=True)):
        ok = [r for r in records if r.outcome.ok]
        statuses = [r.outcome.status for r in records if not r.outcome.ok]
        batch = None
        if len(run.snapshots) > i + 1:
            batch = server_stats.split(run.snapshots[i], run.snapshots[i + 1]).mean_batch_size
        results.append(
            StepResult(
                step=step,
                offered=len(records),
                ok=len(ok),
                good=sum(1 for r in records if good(r)),
                shed=statuses.count(503),
                timed_out=statuses.count(STATUS_TIMEOUT),
                other=len(statuses) - statuses.count(503) - statuses.count(STATUS_TIMEOUT),
                p99_ms={s.metric: percentile_ms(ok, s) if ok else math.inf for s in slos},
                mean_batch=batch,
            )
        )
    return results


@dataclass
class PolicyResult:
    """A policy over the whole trace."""

    name: str
    config: dict[str, object] | None
    steps: list[StepResult]
    duration_s: float
    state: object = None  # the batch policy's own state from the statistics API, after the run

    @property
    def goodput_rps(self) -> float:
        return sum(s.good for s in self.steps) / self.duration_s

    @property
    def shed(self) -> int:
        return sum(s.shed for s in self.steps)

    @property
    def timed_out(self) -> int:
        return sum(s.timed_out for s in self.steps)

    def steps_within(self) -> list[bool]:
        """Per step: at least 99% of its requests answered within every SLO (a 503 or a timeout
        counts as late), i.e. the step's P99 held with failures counted."""
        return [s.offered > 0 and s.good >= WITHIN * s.offered for s in self.steps]

    def widest_load(self) -> float | None:
        """The highest load L such that every step at a load <= L held the SLOs (None: even the
        lightest step missed). The range reported is then [lowest load, L]."""
        within = self.steps_within()
        held: float | None = None
        for load in sorted({s.step.load for s in self.steps}):
            if not all(ok for ok, s in zip(within, self.steps, strict=True) if s.step.load == load):
                break
            held = load
        return held


async def settle(url: str, model: str, *, quiet_s: float = 0.5, limit_s: float = 60.0) -> float:
    """Wait until `model` ran no batch for `quiet_s` (a backlog left by the last run is done);
    the seconds waited. A one-off wait between measurements, never part of one."""
    endpoint = Endpoint.from_url(url)
    timer = PerfTimer()
    start_s = timer.now()
    last = await server_stats.snapshot(endpoint, model)
    while timer.now() - start_s < limit_s:
        await asyncio.sleep(quiet_s)
        now = await server_stats.snapshot(endpoint, model)
        if now is None or last is None or now.num_executions == last.num_executions:
            break
        last = now
    return timer.now() - start_s


def policy_state(url: str, model: str) -> object:
    """What the statistics API says about the model's batch policy (None when it says nothing)."""
    response = httpx.get(f"{url}/v2/models/{model}/stats", timeout=30)
    if response.status_code != 200:
        return None
    rows = response.json().get("model_stats") or [{}]
    return rows[0].get("policy")


def reload(url: str, model: str, override: dict[str, object] | None) -> float:
    """Reload `model` with a config override (None: the file's config); seconds it took."""
    body = {"parameters": {"config": msgspec.json.encode(override).decode()}} if override else {}
    response = httpx.post(f"{url}/v2/repository/models/{model}/load", json=body, timeout=300)
    if response.status_code != 200:
        raise RuntimeError(f"reload {model} with {override}: HTTP {response.status_code}: "
                           f"{response.text[:300]}")  # fmt: skip
    return response.elapsed.total_seconds()

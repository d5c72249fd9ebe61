"""Autoscaling a model's replicas on what its users feel: each replica reports the latency a new
request is predicted to see and the time requests waited in its queue (Serve's custom
autoscaling metrics), and `SloPolicy` sizes the deployment to hold them under the model's SLO.
Ray applies the bounds, delays and scale-from-zero around it. Standard library only: Serve
pickles this module by value into its controller."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LATENCY = "latency_s"  # mean latency of the window's answers; with a queue, the predicted one
QUEUE_DELAY = "queue_delay_s"  # mean time the window's requests waited in the batcher's queue
ONGOING = "ongoing"  # requests admitted and not yet answered (an LLM: its sequences)
BUSY = "busy_fraction"  # share of the window the model's instances spent running batches
# Share of the window's requests refused (503: shed for the SLO, queue full). An SLO-aware batch
# policy keeps the answered ones within the SLO by refusing the rest, so this is where its
# overload shows: demand is served / (1 - refused) of what the replicas answer.
REFUSED = "refused_fraction"
MIN_REFUSED = 0.05  # below this, refusals are a burst's, not a lack of replicas
MAX_REFUSED = 0.75  # caps one decision at 4x
# Scale down towards this busy share. Latency cannot say when replicas are surplus: below
# capacity it is one batch's time however many replicas there are; idle time can.
TARGET_BUSY = 0.6


@dataclass(frozen=True, slots=True)
class Counters:
    """Cumulative figures of one replica's model (its statistics), read at one time."""

    num_requests: int = 0  # answered
    request_ns: int = 0
    queue_ns: int = 0
    num_refused: int = 0
    compute_ns: int = 0  # batches' run time, summed over instances


@dataclass(frozen=True, slots=True)
class Window:
    """What a replica saw between two reports besides its counters."""

    elapsed_s: float
    num_instances: int = 1
    num_queued: int = 0  # requests waiting now
    predicted_s: float = 0.0  # latency a new request would see now (queue ahead + its batch)
    num_ongoing: int = 0


def window_signals(before: Counters, after: Counters, window: Window) -> dict[str, float]:
    """The custom metrics of one report: means over the requests answered since `before`; with
    requests queued, the predicted latency as a floor (a stuck replica answers none)."""
    num = after.num_requests - before.num_requests
    mean_s = (after.request_ns - before.request_ns) / num / 1e9 if num > 0 else 0.0
    queue_s = (after.queue_ns - before.queue_ns) / num / 1e9 if num > 0 else 0.0
    latency_s = max(mean_s, window.predicted_s) if window.num_queued else mean_s
    refused = after.num_refused - before.num_refused
    capacity_ns = window.elapsed_s * 1e9 * max(1, window.num_instances)
    busy = (after.compute_ns - before.compute_ns) / capacity_ns if capacity_ns > 0 else 0.0
    return {
        LATENCY: latency_s, QUEUE_DELAY: queue_s, ONGOING: float(window.num_ongoing),
        REFUSED: refused / (refused + num) if refused > 0 else 0.0, BUSY: min(1.0, busy),
    }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Targets:
    """What the policy holds, in seconds; 0 switches a signal off."""

    slo_s: float = 0.0
    queue_delay_s: float = 0.0
    ongoing_per_replica: float = 2.0  # used only when neither time target is set


@dataclass(frozen=True, slots=True)
class Load:
    """The deployment's state against its targets: `pressure` over 1 needs more replicas;
    `busy` under TARGET_BUSY has too many."""

    pressure: float
    busy: float


def load_of(targets: Targets, metrics: Mapping[str, Mapping[Any, float]]) -> Load:
    """Each signal averaged over the replicas (a new request goes to any of them); the worst
    time signal counts, and refusals count as demand the replicas could not take. Without a
    time target, requests in flight against their target are both the pressure and the use."""
    ratios = []
    if targets.slo_s > 0 and metrics.get(LATENCY):
        ratios.append(_mean(metrics[LATENCY]) / targets.slo_s)
    if targets.queue_delay_s > 0 and metrics.get(QUEUE_DELAY):
        ratios.append(_mean(metrics[QUEUE_DELAY]) / targets.queue_delay_s)
    busy = _mean(metrics.get(BUSY, {}))
    if targets.slo_s <= 0 and targets.queue_delay_s <= 0:
        ongoing = _mean(metrics.get(ONGOING, {})) / targets.ongoing_per_replica
        ratios.append(ongoing)
        busy = max(busy, ongoing * TARGET_BUSY)
    refused = _mean(metrics.get(REFUSED, {}))
    if refused >= MIN_REFUSED:
        ratios.append(1.0 / (1.0 - min(refused, MAX_REFUSED)))
    return Load(max(ratios, default=0.0), busy)


def desired_replicas(current: int, load: Load, *, num_requests: float) -> int:
    """Replicas for `load`: over the targets, grow in proportion (at least one more); else
    shrink towards TARGET_BUSY (never below one while requests are in flight, to zero when
    idle; Serve then applies min_replicas)."""
    if current == 0:
        return 1 if num_requests > 0 else 0
    if load.pressure > 1.0:
        return max(current + 1, math.ceil(current * load.pressure))
    floor = 1 if num_requests > 0 else 0
    return max(floor, min(current, math.ceil(current * load.busy / TARGET_BUSY)))


class SloPolicy:
    """Serve's custom autoscaling policy (a class: Serve makes one with `policy_kwargs`)."""

    def __init__(
        self, slo_ms: float = 0.0, queue_delay_ms: float = 0.0, ongoing_per_replica: float = 2.0
    ) -> None:
        self.targets = Targets(slo_ms / 1000, queue_delay_ms / 1000, ongoing_per_replica)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """`ctx` is Serve's AutoscalingContext (duck-typed: tests pass a plain object)."""
        load = load_of(self.targets, ctx.aggregated_metrics or {})
        num = desired_replicas(
            ctx.current_num_replicas, load, num_requests=float(ctx.total_num_requests)
        )
        state = {"fulcrum_pressure": load.pressure, "fulcrum_busy": load.busy}
        return num, {**ctx.policy_state, **state}


def _mean(values: Mapping[Any, float]) -> float:
    return sum(values.values()) / len(values) if values else 0.0

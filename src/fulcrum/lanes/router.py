"""The lane router: the `Router` the service uses by default. A model without lanes is served
as asked; a laned model's request goes to the lane `choice.choose` picks from each lane's live
state (ready, queue full, estimated finish), and the route says how (`Fulcrum-Route`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from fulcrum.config import ModelConfig
from fulcrum.context import RequestContext
from fulcrum.errors import InvalidInput
from fulcrum.lanes.choice import By, Choice, LaneState, choose, refusal_error
from fulcrum.lanes.settings import default_lane, lane_variant
from fulcrum.router import Route
from fulcrum.types import Clock, MonotonicClock


class LaneServable(Protocol):
    """What the router reads of one lane (a `BatchServable`)."""

    @property
    def is_ready(self) -> bool: ...

    def is_full(self, priority: int | None = None) -> bool: ...

    def estimate_finish_s(self, num_rows: int, now: float) -> float: ...


@dataclass(frozen=True, slots=True)
class LaneTable:
    """A laned model version as loaded now: the model's config and each lane's servable."""

    config: ModelConfig
    lanes: Mapping[str, LaneServable]
    slo_s: Mapping[str, float]  # each lane's latency objective (0: none)


class RouteCounter(Protocol):
    """The `fulcrum_lane_routes` family (model, lane, outcome)."""

    def labels(self, *values: str) -> _Incrementable: ...

    def remove(self, *values: str) -> None: ...


class _Incrementable(Protocol):
    def inc(self, amount: float = 1) -> None: ...


# (model, version) -> the version's lanes, or None when the model declares none; raises NotFound
# (404) for a model that is not loaded, as the repository does.
LaneLookup = Callable[[str, int | None], LaneTable | None]


class LaneRouter:
    """Routes laned models' requests by name or deadline, with spill-over and failover."""

    def __init__(
        self, lookup: LaneLookup, counter: RouteCounter | None = None, clock: Clock | None = None
    ) -> None:
        self._lookup = lookup
        self._counter = counter
        self._clock: Clock = clock or MonotonicClock()
        self._counted: set[tuple[str, str, str]] = set()  # series made, so unload drops them

    def route(self, ctx: RequestContext, model: str, version: int | None) -> Route:
        table = self._lookup(model, version)
        if table is None:
            if ctx.lane is not None:
                raise InvalidInput(f"model '{model}' has no lane {ctx.lane!r} (lanes: [])")
            return Route(model, version, None, ctx.variant)
        choice = self._choose(ctx, table, self._clock.now())
        self._count(model, choice.lane, choice.outcome)
        if choice.outcome == "refused":
            raise refusal_error(choice)
        return Route(model, version, choice.lane, choice.variant, route_header(choice))

    def _choose(self, ctx: RequestContext, table: LaneTable, now: float) -> Choice:
        config = table.config
        # A batched model's request runs as its rows: 64 rows finish later than one.
        num_rows = max(1, ctx.num_rows) if config.max_batch_size > 0 else 1
        states = [
            LaneState(
                name,
                lane_variant(config, name),
                table.slo_s[name],
                servable.is_ready,
                servable.is_full(ctx.priority),
                servable.estimate_finish_s(num_rows, now),
            )
            for name, servable in table.lanes.items()
            if ctx.variant is None or lane_variant(config, name) == ctx.variant
        ]
        if not states:
            raise InvalidInput(f"model '{config.name}' has no lane over variant {ctx.variant!r}")
        by: By = "name" if ctx.lane is not None else "variant" if ctx.variant else "default"
        default = default_lane(config)
        if all(s.name != default for s in states):
            default = states[0].name
        budget_s = None if ctx.deadline_s is None else ctx.deadline_s - now
        return choose(states, named=ctx.lane, by=by, budget_s=budget_s, default=default,
                      model=config.name)  # fmt: skip

    def forget(self, model: str) -> None:
        """Drop an unloaded model's route counters (series exist only for loaded models)."""
        for key in [k for k in self._counted if k[0] == model]:
            self._counted.discard(key)
            if self._counter is not None:
                self._counter.remove(*key)

    def _count(self, model: str, lane: str, outcome: str) -> None:
        if self._counter is not None:
            self._counter.labels(model, lane, outcome).inc()
            self._counted.add((model, lane, outcome))


def route_header(choice: Choice) -> str:
    """The `Fulcrum-Route` value: `lane=<taken>; by=<name|deadline|variant|default>`, and
    `spilled-from=<home>` or `failed-over-from=<home>` when the home lane could not take it."""
    text = f"lane={choice.lane}; by={choice.by}"
    if choice.outcome == "spilled":
        text += f"; spilled-from={choice.home}"
    elif choice.outcome == "failed_over":
        text += f"; failed-over-from={choice.home}"
    return text

"""What the service does for a laned model: read a request's lane parameter and timeout into its
context, find a version's lanes in the repository for the router, and hand the route's lane."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from fulcrum.context import with_parameter
from fulcrum.errors import InvalidInput
from fulcrum.lanes.group import LaneGroup
from fulcrum.lanes.router import LaneTable
from fulcrum.lanes.settings import lane_variant
from fulcrum.servable import BatchServable

if TYPE_CHECKING:
    from fulcrum.context import RequestContext
    from fulcrum.repository import ModelRepository, Servable
    from fulcrum.router import Route


def with_lane(ctx: RequestContext, lane: object) -> RequestContext:
    """The context with the request's `lane` parameter (v2); it may not contradict the
    X-Fulcrum-Lane header."""
    return with_parameter(ctx, "lane", lane)


def with_timeout(ctx: RequestContext, timeout_s: float | None, now_s: float) -> RequestContext:
    """The context with the v2 `timeout` parameter folded into its deadline, so the router sees
    the one deadline the batcher will hold the request to (the earlier of the two)."""
    if not timeout_s or timeout_s < 0:
        return ctx
    deadline_s = now_s + timeout_s
    if ctx.deadline_s is not None and ctx.deadline_s <= deadline_s:
        return ctx
    return dataclasses.replace(ctx, deadline_s=deadline_s)


def lane_table(repository: ModelRepository, name: str, version: int | None) -> LaneTable | None:
    """The lanes that serve `name` (default: its highest version) now, in config order; None for
    a model without lanes. NotFound / Unavailable as `repository.get`."""
    config, number, _ = repository.get(name, version)
    if not config.lanes:
        return None
    lanes: dict[str, BatchServable] = {}
    slo_s: dict[str, float] = {}
    for variant in dict.fromkeys(lane_variant(config, lane) for lane in config.lanes):
        _, _, group = repository.get(name, number, variant)
        if isinstance(group, LaneGroup):
            lanes.update(group.lanes)
            slo_s.update(group.slo_s)
    ordered = {lane: lanes[lane] for lane in config.lanes if lane in lanes}
    return LaneTable(config, ordered, slo_s)


def batch_servables(servable: Servable) -> list[BatchServable]:
    """The batchers behind one loaded variant: its lanes, itself, or none (a generative model)."""
    if isinstance(servable, LaneGroup):
        return list(servable.lanes.values())
    return [servable] if isinstance(servable, BatchServable) else []


def lane_of(servable: Servable, route: Route) -> Servable:
    """The servable of the route's lane when `servable` is a variant's lane group."""
    if not isinstance(servable, LaneGroup):
        return servable
    try:
        return servable.lane(route.lane)
    except KeyError:
        raise InvalidInput(
            f"model '{route.model}' has no lane {route.lane!r} over variant {servable.variant!r} "
            f"(lanes: {list(servable.lanes)})"
        ) from None

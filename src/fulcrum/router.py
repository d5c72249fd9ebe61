"""The routing seam: which model version and lane serve a request, for both APIs. The direct
router serves what was asked; `fulcrum.lanes.LaneRouter` (the service's default) adds lanes,
spill-over and failover."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from fulcrum.context import RequestContext

ROUTE_HEADER = "Fulcrum-Route"  # the lane a laned model's request took, and why


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: the model, version and variant that serve it, and the lane."""

    model: str
    version: int | None
    lane: str | None = None
    variant: str | None = None  # None: the model's default variant
    header: str | None = None  # the `Fulcrum-Route` response header (laned, A/B models)
    arm: str | None = None  # the A/B arm the split chose (fulcrum.routing.ab); None: no split


class Router(Protocol):
    """Picks the model version (and lane) for a request; the default serves what was asked."""

    def route(self, ctx: RequestContext, model: str, version: int | None) -> Route: ...


class DirectRouter:
    """No routing: the named model, version and variant, in the context's lane."""

    def route(self, ctx: RequestContext, model: str, version: int | None) -> Route:
        return Route(model, version, ctx.lane, ctx.variant)

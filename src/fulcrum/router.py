"""The routing seam: which model version and lane serve a request. The default serves what was
asked; lanes, spill-over and A/B choose here later, for both APIs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from fulcrum.context import RequestContext


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes: the model, version and variant that serve it, and the lane."""

    model: str
    version: int | None
    lane: str | None = None
    variant: str | None = None  # None: the model's default variant


class Router(Protocol):
    """Picks the model version (and lane) for a request; the default serves what was asked."""

    def route(self, ctx: RequestContext, model: str, version: int | None) -> Route: ...


class DirectRouter:
    """No routing: the named model, version and variant, in the context's lane."""

    def route(self, ctx: RequestContext, model: str, version: int | None) -> Route:
        return Route(model, version, ctx.lane, ctx.variant)

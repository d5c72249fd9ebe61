"""The result-cache seam in front of the batch models: the service asks it before a request is
queued and tells it each result; tiers (exact, semantic, Redis) implement it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fulcrum.batcher import InferResult
    from fulcrum.context import RequestContext
    from fulcrum.router import Route
    from fulcrum.types import TensorMap


class ResultCache(Protocol):
    """A result cache in front of the batch models (the caching issue fills this seam)."""

    async def get(
        self, ctx: RequestContext, route: Route, version: int, inputs: TensorMap
    ) -> InferResult | None: ...

    async def put(
        self, ctx: RequestContext, route: Route, version: int, inputs: TensorMap,
        result: InferResult,
    ) -> None: ...  # fmt: skip

"""The A/B split: a request without an explicit variant (or version) goes to the arm its key
hashes to, so the same key always gets the same arm while the weights stay the same.

The key is the `X-Fulcrum-AB-Key` header, else the tenant. Its SHA-256 (salted with the model's
name, so two experiments do not split users the same way) maps to a point in [0, 1); the arms,
in name order (reordering the file moves no one), cover that interval by their weights. A
request that names a variant, lane (which runs one variant) or version is outside the split.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping

from fulcrum.config import ModelConfig
from fulcrum.context import RequestContext
from fulcrum.errors import NotFound
from fulcrum.router import Route, Router
from fulcrum.routing.settings import AbSettings

# (model, version) -> the config that serves it now; NotFound (404) when it is not loaded
ConfigLookup = Callable[[str, int | None], ModelConfig]


def split_point(model: str, key: str) -> float:
    """Where `key` falls in [0, 1) for `model`'s split: stable across processes and restarts."""
    digest = hashlib.sha256(f"{model}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / float(1 << 64)


def arm_of(model: str, key: str, arms: Mapping[str, float]) -> str:
    """The arm `key` belongs to under `arms`' weights (arms of weight 0 get no one)."""
    ordered = sorted((name, weight) for name, weight in arms.items() if weight > 0)
    total = sum(weight for _, weight in ordered)
    point = split_point(model, key) * total
    reached = 0.0
    for name, weight in ordered:
        reached += weight
        if point < reached:
            return name
    return ordered[-1][0]  # rounding at the top end


def is_explicit(ctx: RequestContext, version: int | None, ab: AbSettings) -> bool:
    """Whether the request chose for itself: a variant or lane (by variant), a version."""
    if ab.by == "version":
        return version is not None
    return ctx.variant is not None or ctx.lane is not None


def split_arm(
    ctx: RequestContext, model: str, version: int | None, ab: AbSettings | None
) -> str | None:
    """The arm of a request under `ab` (None: no split, or the request chose for itself)."""
    if ab is None or is_explicit(ctx, version, ab):
        return None
    return arm_of(model, ctx.ab_key or ctx.tenant, ab.arms)


class AbRouter:
    """A `Router` that applies a model's `[routing.ab]` split, then hands the request, with its
    arm's variant or version, to the inner router (the lane router by default)."""

    def __init__(self, inner: Router, lookup: ConfigLookup) -> None:
        self.inner = inner
        self._lookup = lookup

    def route(self, ctx: RequestContext, model: str, version: int | None) -> Route:
        try:
            ab = self._lookup(model, version).routing.ab
        except NotFound:  # a name the inner router resolves (an alias), or a 404 it will raise
            return self.inner.route(ctx, model, version)
        arm = split_arm(ctx, model, version, ab)
        if ab is None or arm is None:
            return self.inner.route(ctx, model, version)
        if ab.by == "variant":
            route = self.inner.route(dataclasses.replace(ctx, variant=arm), model, version)
        else:
            route = self.inner.route(ctx, model, int(arm))
        header = f"ab={arm}" if route.header is None else f"ab={arm}; {route.header}"
        return dataclasses.replace(route, arm=arm, header=header)

    def forget(self, model: str) -> None:
        """The inner router's `forget` (the lane router drops an unloaded model's counters)."""
        forget = getattr(self.inner, "forget", None)
        if forget is not None:
            forget(model)

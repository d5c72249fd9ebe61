"""The routing hooks around one batch request's run, for the service: the A/B arm's metrics,
then, once the caller's answer is ready, its shadow (if the model has one)."""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable

from fulcrum.batch_request import InferResult
from fulcrum.config import ModelConfig, load_model_config
from fulcrum.context import RequestContext
from fulcrum.errors import ConfigError, FulcrumError, NotFound
from fulcrum.lanes.serving import batch_servables
from fulcrum.repository import ModelRepository
from fulcrum.router import Route
from fulcrum.routing.cascade import check_compatible
from fulcrum.routing.metrics import RoutingMetrics
from fulcrum.routing.settings import ShadowSettings
from fulcrum.routing.shadow import ShadowRunner
from fulcrum.servable import BatchServable
from fulcrum.service_run import CACHE_API
from fulcrum.types import TensorMap
from fulcrum.variants import default_variant

# (the caller's route and servable, the shadow settings) -> the reference's servable, or raises
ReferenceLookup = Callable[[Route, BatchServable, ShadowSettings], BatchServable]


class RoutingHooks:
    """Owns the routing metrics and the shadow runner; `observe` wraps each batch run."""

    def __init__(
        self, metrics: RoutingMetrics, reference: ReferenceLookup, rng: random.Random | None = None
    ) -> None:
        self.metrics = metrics
        self.shadows = ShadowRunner(metrics, rng)
        self._reference = reference

    async def observe(
        self,
        ctx: RequestContext,
        route: Route,
        servable: BatchServable,
        inputs: TensorMap,
        compute: Callable[[], Awaitable[InferResult]],
    ) -> InferResult:
        """Run `compute` (the caller's request), count it under its arm, then maybe shadow it;
        the cache's own calls (its semantic tier's embeddings) pass straight through."""
        if ctx.api == CACHE_API:
            return await compute()
        start_s = time.perf_counter()
        try:
            result = await compute()
        except FulcrumError:
            if route.arm is not None:
                self.metrics.record_arm(route.model, route.arm, ok=False, seconds=0.0, rows=0)
            raise
        if route.arm is not None:
            rows = num_rows(inputs) if servable.config.max_batch_size > 0 else 1
            seconds = time.perf_counter() - start_s
            self.metrics.record_arm(route.model, route.arm, ok=True, seconds=seconds, rows=rows)
        shadow = servable.config.routing.shadow
        if shadow is not None and not _is_reference(route, servable, shadow):
            self.shadows.offer(
                servable, shadow, lambda: self._reference(route, servable, shadow), inputs, result
            )
        return result


def _is_reference(route: Route, servable: BatchServable, shadow: ShadowSettings) -> bool:
    """Whether the caller already ran on the reference (nothing to compare)."""
    variant = route.variant or default_variant(servable.config)
    if shadow.version:
        return servable.version == shadow.version
    return variant == shadow.variant


def num_rows(inputs: TensorMap) -> int:
    """The rows of a batched model's request: its first input's first dimension."""
    first = next(iter(inputs.values()), None)
    return 1 if first is None or first.ndim == 0 else int(first.shape[0])


def shadow_reference(
    repository: ModelRepository, route: Route, caller: BatchServable, shadow: ShadowSettings
) -> BatchServable:
    """The servable a shadow of `caller`'s request runs on: the reference variant of the
    caller's version, or the reference version's default variant; a laned reference's least
    queued lane. NotFound / Unavailable when it is not loaded."""
    version = shadow.version or caller.version
    _, _, loaded = repository.get(route.model, version, shadow.variant or None)
    found = batch_servables(loaded)
    if not found:
        raise NotFound(f"model '{route.model}': the shadow reference is not a batch model")
    return min(found, key=lambda s: s.queue_depth)


def check_cascade(repository: ModelRepository, config: ModelConfig) -> None:
    """At load: a cascade's second model (its config in the repository) must take this model's
    inputs and give its outputs; ConfigError names the key and the mismatch."""
    cascade = config.routing.cascade
    if cascade is None:
        return
    path = repository.root / cascade.then / "config.toml"
    if not path.is_file():
        raise ConfigError(
            f"key 'routing.cascade.then' = {cascade.then!r}: no such model in the repository"
        )
    check_compatible(config, load_model_config(path, dir_name=cascade.then))

"""A version's lanes over one variant: each lane its own `BatchServable` (instances, batcher,
policy); the repository holds the group where it would hold the variant's one servable, so a
reload swaps, warms and drains a laned model's lanes exactly as it does a variant."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

from fulcrum.config import ModelConfig
from fulcrum.lanes.settings import default_lane, lane_config, lane_variant, oversubscription
from fulcrum.servable import BatchServable

log = logging.getLogger(__name__)

# (the lane's config, the lane's name) -> a started servable
LoadLane = Callable[[ModelConfig, str], Awaitable[BatchServable]]


class LaneGroup:
    """The lanes of one version that run one variant; started and stopped together."""

    def __init__(self, variant: str, lanes: dict[str, BatchServable]) -> None:
        self.variant = variant
        self.lanes = lanes
        self.slo_s = {name: _slo_s(s.config) for name, s in lanes.items()}

    @property
    def is_ready(self) -> bool:
        """Ready while any lane is: the router fails a request over from a lane that is down."""
        return any(s.is_ready for s in self.lanes.values())

    def lane(self, name: str | None) -> BatchServable:
        """The lane `name` (None: the group's first); KeyError for a lane of another variant."""
        return self.lanes[name] if name is not None else next(iter(self.lanes.values()))

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.lanes.values()), return_exceptions=True)


def lanes_over(config: ModelConfig, variant: str) -> list[str]:
    """The lanes of `config` that run `variant`, in file order."""
    return [name for name in config.lanes if lane_variant(config, name) == variant]


async def load_lane_group(config: ModelConfig, variant: str, load: LoadLane) -> LaneGroup:
    """Start every lane over `variant` (`config`: the variant's resolved config); a lane that
    fails stops the ones already started."""
    if variant == lane_variant(config, default_lane(config)):  # once per model load
        warning = oversubscription(config, os.cpu_count() or 1)
        if warning is not None:
            log.warning("%s", warning)
    started: dict[str, BatchServable] = {}
    try:
        for name in lanes_over(config, variant):
            started[name] = await load(lane_config(config, name), name)
    except BaseException:
        await asyncio.gather(*(s.stop() for s in started.values()), return_exceptions=True)
        raise
    return LaneGroup(variant, started)


def _slo_s(config: ModelConfig) -> float:
    batching = config.dynamic_batching
    return batching.slo_p99_ms / 1000 if batching is not None else 0.0

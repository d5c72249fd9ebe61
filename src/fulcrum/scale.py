"""The `[scale]` table of a model's `config.toml`: how many replicas of the model a Ray Serve
cluster runs, what each one reserves, and the latency targets its autoscaler holds. Read by
`fulcrum.ray`; a single-process server ignores it, so the repository stays the one source."""

from __future__ import annotations

import math

import msgspec

from fulcrum.errors import ConfigError

# Beyond these a value is a typo, not a setting: ten thousand replicas of one model, an hour's
# wait before scaling.
MAX_REPLICAS_LIMIT = 10_000
MAX_DELAY_S = 3600.0
MAX_TARGET_MS = 3_600_000.0


class ScaleSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One model's replicas and autoscaling on Ray Serve (see README, "Ray Serve")."""

    min_replicas: int = 1  # 0: the model scales to zero when idle
    max_replicas: int = 1  # > min_replicas: autoscaled between the two
    initial_replicas: int | None = None  # None: min_replicas (at least 1 when min is 0)
    num_cpus: float = 1.0  # reserved per replica; the model's instances share it
    num_gpus: float = 0.0
    # The autoscaler's targets: the latency a new request is predicted to see (queue + its
    # batch) against the SLO, and the mean time requests wait in the batcher's queue. 0: from
    # `[dynamic_batching] slo_p99_ms` (the SLO) and a quarter of the SLO (the queue delay).
    slo_ms: float = 0.0
    target_queue_delay_ms: float = 0.0
    # Without any SLO: requests in flight per replica (Ray's own `target_ongoing_requests`).
    target_ongoing_requests: float = 0.0  # 0: twice max_batch_size (or 2); an LLM: 16 sequences
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0
    max_ongoing_requests: int = 0  # per replica, beyond which Serve queues in the caller; 0: auto

    @property
    def autoscaled(self) -> bool:
        return self.max_replicas > self.min_replicas


def validate_scale(scale: ScaleSettings) -> None:
    """Checks msgspec's types cannot express; each error names the key and the bad value."""
    if not 0 <= scale.min_replicas <= MAX_REPLICAS_LIMIT:
        raise ConfigError(
            f"key 'scale.min_replicas' = {scale.min_replicas}: must lie in 0..{MAX_REPLICAS_LIMIT}"
        )
    if not max(1, scale.min_replicas) <= scale.max_replicas <= MAX_REPLICAS_LIMIT:
        raise ConfigError(
            f"key 'scale.max_replicas' = {scale.max_replicas}: must lie in "
            f"max(1, min_replicas)..{MAX_REPLICAS_LIMIT}"
        )
    initial = scale.initial_replicas
    if initial is not None and not scale.min_replicas <= initial <= scale.max_replicas:
        raise ConfigError(
            f"key 'scale.initial_replicas' = {initial}: must lie in min_replicas.."
            f"max_replicas ({scale.min_replicas}..{scale.max_replicas})"
        )
    _check_range("num_cpus", scale.num_cpus, 0.0, 1024.0)
    _check_range("num_gpus", scale.num_gpus, 0.0, 64.0)
    _check_range("slo_ms", scale.slo_ms, 0.0, MAX_TARGET_MS)
    _check_range("target_queue_delay_ms", scale.target_queue_delay_ms, 0.0, MAX_TARGET_MS)
    _check_range("target_ongoing_requests", scale.target_ongoing_requests, 0.0, 1e6)
    _check_range("upscale_delay_s", scale.upscale_delay_s, 0.0, MAX_DELAY_S)
    _check_range("downscale_delay_s", scale.downscale_delay_s, 0.0, MAX_DELAY_S)
    if scale.max_ongoing_requests < 0:
        raise ConfigError(
            f"key 'scale.max_ongoing_requests' = {scale.max_ongoing_requests}: must be >= 0"
        )


def _check_range(key: str, value: float, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):  # NaN too
        raise ConfigError(f"key 'scale.{key}' = {value}: must lie in {low:g}..{high:g}")

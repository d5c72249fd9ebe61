"""The `[lifecycle]` table of a model's `config.toml`: when an idle model unloads, how long a
request waits for it to load again, and whether the memory budget may evict it."""

from __future__ import annotations

import math

import msgspec

from fulcrum.errors import ConfigError

# Beyond these a value is a typo, not a setting: a model parked after a year, a request that
# waits a day for its model.
MAX_IDLE_UNLOAD_S = 366 * 24 * 3600.0
MAX_LOAD_TIMEOUT_S = 24 * 3600.0


class LifecycleSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One model's scale-to-zero settings (see README, "Scale to zero and a memory budget")."""

    idle_unload_s: float = 0.0  # 0: never unloaded for being idle
    load_timeout_s: float = 120.0  # the longest a request waits for its model's cold start
    evictable: bool = True  # False: the memory budget never unloads it (it still counts)


def validate_lifecycle(settings: LifecycleSettings) -> None:
    """Checks msgspec's types cannot express; each error names the key and the bad value."""
    idle_s = settings.idle_unload_s
    if not (math.isfinite(idle_s) and 0 <= idle_s <= MAX_IDLE_UNLOAD_S):
        raise ConfigError(
            f"key 'lifecycle.idle_unload_s' = {idle_s}: must lie in 0..{MAX_IDLE_UNLOAD_S:g} "
            "(0: never)"
        )
    timeout_s = settings.load_timeout_s
    if not (math.isfinite(timeout_s) and 0 < timeout_s <= MAX_LOAD_TIMEOUT_S):
        raise ConfigError(
            f"key 'lifecycle.load_timeout_s' = {timeout_s}: must lie in (0, {MAX_LOAD_TIMEOUT_S:g}]"
        )

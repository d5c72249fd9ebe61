"""Lane settings: what a `[lanes.<name>]` table makes of the model's config, checked at load.

A lane is the model's config with its variant's parameters laid over the model's, then the
lane's own instances, threads and `[dynamic_batching]` over that (a key the lane leaves out keeps
the model's value). Each lane owns its instances: lanes never share a slot, so no batch policy
has to know about another lane's batches; `oversubscription` says when their threads together
ask for more cores than the machine has.
"""

from __future__ import annotations

import msgspec

from fulcrum.config import (
    VARIANT_NAME_RE,
    DynamicBatching,
    ModelConfig,
    apply_profile,
    validate,
)
from fulcrum.errors import ConfigError
from fulcrum.variants import default_variant, loaded_variant_names, resolve_variant

# The parameter each platform reads as an instance's thread count.
THREAD_PARAMETER = {"onnx": "intra_op_threads", "torch": "num_threads"}


def lane_names(config: ModelConfig) -> list[str]:
    """The declared lanes in file order (empty: the model has none)."""
    return list(config.lanes)


def default_lane(config: ModelConfig) -> str:
    """The lane a request goes to when it names none and has no deadline to choose by."""
    return config.default_lane or next(iter(config.lanes))


def lane_variant(config: ModelConfig, name: str) -> str:
    """The variant lane `name` runs."""
    return config.lanes[name].variant or default_variant(config)


def lane_config(config: ModelConfig, name: str) -> ModelConfig:
    """The config lane `name` runs: variant parameters, then the lane's own keys, laid over the
    model's; its `lanes` table is empty (a lane has no lanes)."""
    lane = config.lanes[name]
    resolved = resolve_variant(config, lane_variant(config, name))
    parameters = dict(resolved.parameters)
    key = THREAD_PARAMETER.get(config.platform)
    if lane.threads and key is not None:
        parameters[key] = lane.threads
    resolved = msgspec.structs.replace(
        resolved,
        parameters=parameters,
        instances=lane.instances or resolved.instances,
        dynamic_batching=lane.dynamic_batching or resolved.dynamic_batching,
        lanes={},
        default_lane="",
    )
    if lane.dynamic_batching is not None:
        resolved = apply_profile(resolved, _keys_set(lane.dynamic_batching))
    return resolved


def validate_lanes(config: ModelConfig) -> None:
    """Names, variants and the default lane; then each lane's resolved config as a model's,
    with errors naming the lane's key (`key 'lanes.bulk.dynamic_batching.slo_p99_ms'`)."""
    if config.platform == "llm":
        raise ConfigError(
            "key 'lanes': lanes serve batch models (v2 and embeddings); a generative model "
            "(platform 'llm') schedules its own continuous batch and takes no lanes"
        )
    if not config.lanes:
        raise ConfigError(f"key 'default_lane' = {config.default_lane!r}: no [lanes] declared")
    loaded = loaded_variant_names(config)
    for name, lane in config.lanes.items():
        if not VARIANT_NAME_RE.fullmatch(name):
            raise ConfigError(f"key 'lanes.{name}': use letters, digits, '_', '-', '.'")
        if lane.variant and lane.variant not in loaded:
            raise ConfigError(
                f"key 'lanes.{name}.variant' = {lane.variant!r}: not a loaded variant {loaded}"
            )
        if lane.threads < 0:
            raise ConfigError(f"key 'lanes.{name}.threads' = {lane.threads}: must be >= 0")
        try:
            validate(lane_config(config, name))
        except ConfigError as exc:
            raise ConfigError(exc.message.replace("key '", f"key 'lanes.{name}.")) from None
    if config.default_lane and config.default_lane not in config.lanes:
        raise ConfigError(
            f"key 'default_lane' = {config.default_lane!r}: not one of the lanes "
            f"{lane_names(config)}"
        )


def lane_threads(config: ModelConfig, name: str, num_cores: int) -> int:
    """Cores lane `name` may keep busy: instances x threads (a thread count of 0 lets the
    runtime take every core)."""
    resolved = lane_config(config, name)
    key = THREAD_PARAMETER.get(config.platform)
    threads = resolved.parameters.get(key, 0) if key is not None else 1
    per_instance = threads if isinstance(threads, int) and threads > 0 else num_cores
    return resolved.instances.count * per_instance


def oversubscription(config: ModelConfig, num_cores: int) -> str | None:
    """A warning when the lanes' instances x threads exceed the machine's cores, else None."""
    counts = {name: lane_threads(config, name, num_cores) for name in config.lanes}
    total = sum(counts.values())
    if total <= num_cores:
        return None
    shown = ", ".join(f"{name}: {n}" for name, n in counts.items())
    return (
        f"model '{config.name}': its lanes ask for {total} threads on {num_cores} cores "
        f"({shown}); lanes then slow each other down: lower [lanes.<name>] threads or instances"
    )


def _keys_set(batching: DynamicBatching) -> frozenset[str]:
    # A lane's table is decoded already: a key counts as set when it differs from the default,
    # so the lane's profile fills only what the lane left at its default.
    default = DynamicBatching()
    return frozenset(
        f for f in batching.__struct_fields__ if getattr(batching, f) != getattr(default, f)
    )

"""The Serve application of a model repository: an ingress deployment serving Fulcrum's HTTP
APIs, one deployment per model whose replicas run it in process, and the statistics hub.
Replicas, resources and autoscaling come from each model's `[scale]` table."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec

from fulcrum.config import ModelConfig, load_model_config
from fulcrum.errors import ConfigError
from fulcrum.extras import require
from fulcrum.ray.autoscale import SloPolicy
from fulcrum.ray.forward import CallPolicy
from fulcrum.ray.hub import StatsHub
from fulcrum.ray.replica import ModelReplica
from fulcrum.service import ServiceSettings

POLICY_PATH = f"{SloPolicy.__module__}:{SloPolicy.__name__}"
INGRESS_NAME = "fulcrum"
HUB_NAME = "fulcrum-stats"
MODEL_PREFIX = "model-"
LLM_MAX_ONGOING = 256  # an LLM replica's engine takes many sequences at once
LLM_TARGET_SEQUENCES = 16.0  # running + waiting sequences per LLM replica, without an SLO
HEALTH_CHECK_PERIOD_S = 2.0
# Serve averages the signals over this window; it must exceed Serve's (deprecated, 10 s)
# metrics interval, or Serve warns. The signals themselves arrive every push interval
# (RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S), so a burst shows within seconds.
LOOK_BACK_S = 11.0
# Serve logs every request of every replica by default: a line per request at the rates Fulcrum
# serves costs more than the request. Fulcrum's own metrics and statistics count them instead.
QUIET = {"enable_access_log": False}
Positive = Annotated[float, msgspec.Meta(gt=0)]


class AppArgs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """`serve run fulcrum.ray:app_builder key=value ...` or a Serve config's `args`."""

    repository: str
    models: list[str] | str = []  # none: every model in the repository; "a,b" from the CLI
    request_timeout_s: Positive = 60.0  # the ingress's bound on one call to a model's replica
    ingress_replicas: Annotated[int, msgspec.Meta(ge=1)] = 1
    ingress_num_cpus: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    admin_token: str | None = None
    admin_open: bool = False  # management routes with no token (a loopback-only cluster)
    max_body_mb: Annotated[int, msgspec.Meta(ge=1)] = 64
    drain_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0

    def model_names(self, root: Path) -> list[str]:
        names = self.models.split(",") if isinstance(self.models, str) else self.models
        chosen = [n.strip() for n in names if n.strip()]
        return chosen or sorted(p.parent.name for p in root.glob("*/config.toml"))


def parse_args(args: Mapping[str, object]) -> AppArgs:
    """The builder's arguments, from strings (`serve run`) or typed values (a config file)."""
    try:
        return msgspec.convert(dict(args), AppArgs, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"fulcrum.ray:app_builder arguments: {exc}") from None


def deployment_options(config: ModelConfig) -> dict[str, Any]:
    """Serve's options for one model's deployment, from its `[scale]` table."""
    scale = config.scale
    rows = max(1, config.max_batch_size) * config.instances.count
    auto_ongoing = LLM_MAX_ONGOING if config.platform == "llm" else max(32, 4 * rows)
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": scale.num_cpus, "num_gpus": scale.num_gpus},
        # The batcher is the queue that counts (bounded, shedding with 503): Serve's own limit
        # must stay above a full batch or it would starve the batcher.
        "max_ongoing_requests": scale.max_ongoing_requests or auto_ongoing,
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "logging_config": QUIET,
    }
    if not scale.autoscaled and scale.min_replicas > 0:
        options["num_replicas"] = scale.min_replicas
        return options
    options["autoscaling_config"] = {
        "min_replicas": scale.min_replicas,
        "max_replicas": scale.max_replicas,
        "initial_replicas": scale.initial_replicas,
        "upscale_delay_s": scale.upscale_delay_s,
        "downscale_delay_s": scale.downscale_delay_s,
        "look_back_period_s": max(LOOK_BACK_S, 2 * scale.upscale_delay_s),
        "policy": {"policy_function": POLICY_PATH, "policy_kwargs": _policy_kwargs(config)},
    }
    return options


def _policy_kwargs(config: ModelConfig) -> dict[str, float]:
    scale = config.scale
    batching = config.dynamic_batching
    slo_ms = scale.slo_ms or (batching.slo_p99_ms if batching is not None else 0.0)
    queue_ms = scale.target_queue_delay_ms or slo_ms / 4
    default_ongoing = (
        LLM_TARGET_SEQUENCES if config.platform == "llm" else 2.0 * max(1, config.max_batch_size)
    )
    ongoing = scale.target_ongoing_requests or default_ongoing
    return {"slo_ms": slo_ms, "queue_delay_ms": queue_ms, "ongoing_per_replica": ongoing}


def folder_version(model_dir: Path) -> str:
    """A digest of the model's folder (its config and each file's name, size and time). Passed
    to the replicas' constructor, it is part of what Serve compares on a redeploy: a changed
    config or a new version folder rolls out replica by replica; an unchanged model stays."""
    digest = hashlib.sha256()
    for path in sorted(model_dir.rglob("*")):
        if path.is_file():
            stat = path.stat()
            digest.update(
                f"{path.relative_to(model_dir)}:{stat.st_size}:{stat.st_mtime_ns};".encode()
            )
    digest.update((model_dir / "config.toml").read_bytes())
    return digest.hexdigest()[:16]


def deployment_name(model: str) -> str:
    return f"{MODEL_PREFIX}{model}"


def build_app(raw_args: Mapping[str, object]) -> Any:
    """The application (`serve.Application`) serving `repository`."""
    serve = require("ray", "ray.serve", feature="serving on a Ray Serve cluster")
    from fulcrum.ray.ingress_deployment import Ingress

    args = parse_args(raw_args)
    root = Path(args.repository).expanduser().resolve()  # the same path on every node
    if not root.is_dir():
        raise ConfigError(f"repository {args.repository!r} is not a folder")
    names = args.model_names(root)
    configs = {n: load_model_config(root / n / "config.toml", dir_name=n) for n in names}
    # Its requests are the replicas' long polls: nothing to drain when it stops.
    hub = serve.deployment(
        StatsHub, name=HUB_NAME, num_replicas=1, max_ongoing_requests=100_000,
        ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=1.0,
        graceful_shutdown_wait_loop_s=0.5, logging_config=QUIET,
    ).bind()  # fmt: skip
    handles = {
        name: serve.deployment(
            ModelReplica, name=deployment_name(name), **deployment_options(config)
        ).bind(str(root), name, hub, folder_version(root / name))
        for name, config in configs.items()
    }
    settings = ServiceSettings(
        max_body_bytes=args.max_body_mb * 1024 * 1024,
        drain_timeout_s=args.drain_timeout_s,
        load_models=tuple(names),
    )
    ingress = serve.deployment(
        serve.ingress()(Ingress), name=INGRESS_NAME, num_replicas=args.ingress_replicas,
        max_ongoing_requests=10_000, ray_actor_options={"num_cpus": args.ingress_num_cpus},
        logging_config=QUIET,
    )  # fmt: skip
    call = CallPolicy(timeout_s=args.request_timeout_s)
    return ingress.bind(str(root), handles, hub, settings, call, args.admin_token, args.admin_open)

"""`fulcrum serve --ray`: the repository's application deployed on a Ray cluster (an existing
one at `--address`, or a local one started for the purpose), with Serve's HTTP proxy on the
given host and port, running until interrupted."""

from __future__ import annotations

from dataclasses import dataclass

from fulcrum.extras import require

APP_NAME = "fulcrum"


@dataclass(frozen=True, slots=True)
class RayServeOptions:
    repository: str
    models: tuple[str, ...]
    host: str
    port: int
    address: str | None  # None: start a local cluster in this process
    admin_token: str | None
    admin_open: bool
    drain_timeout_s: float
    max_body_mb: int


def serve_on_ray(options: RayServeOptions) -> int:
    """Deploy and block until Ctrl-C; the application is deleted on the way out."""
    ray = require("ray", "ray", feature="`fulcrum serve --ray`")
    serve = require("ray", "ray.serve", feature="`fulcrum serve --ray`")
    from fulcrum.ray.app import build_app

    ray.init(address=options.address, ignore_reinit_error=True)
    serve.start(http_options={"host": options.host, "port": options.port})
    args: dict[str, object] = {
        "repository": options.repository,
        "models": list(options.models),
        "admin_open": options.admin_open,
        "drain_timeout_s": options.drain_timeout_s,
        "max_body_mb": options.max_body_mb,
    }
    if options.admin_token:
        args["admin_token"] = options.admin_token
    serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=True)
    return 0

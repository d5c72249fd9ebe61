"""The ingress deployment's class: builds, on its replica, the ordinary Starlette app over a
`RayService`, with the ingress's own routes in front (`fulcrum.ray.routes`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp

from fulcrum.ray.forward import CallPolicy
from fulcrum.ray.ingress import RayService
from fulcrum.ray.routes import add_ray_routes
from fulcrum.server.app import create_app
from fulcrum.service import ServiceSettings


class Ingress:
    """Wrapped by `serve.ingress()`: Serve calls `__serve_build_asgi_app__` after `__init__`
    and runs the app's lifespan (which starts the service: the model stubs, no weights)."""

    def __init__(
        self,
        repository: str,
        handles: Mapping[str, Any],
        hub: Any,
        settings: ServiceSettings,
        call: CallPolicy,
        admin_token: str | None = None,
        admin_open: bool = False,
    ) -> None:
        self.service = RayService(Path(repository), handles, hub, settings, call)
        self.admin_token = admin_token
        self.admin_open = admin_open

    def __serve_build_asgi_app__(self) -> ASGIApp:
        app = create_app(self.service, admin_token=self.admin_token, admin_open=self.admin_open)
        add_ray_routes(app, self.service)
        return app

"""The Starlette application: v2 routes, OpenAI routes, metrics, lifespan and admin guard."""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from fulcrum.server.http import http_error
from fulcrum.server.openai import openai_routes
from fulcrum.server.v2 import V2Api
from fulcrum.service import Service

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def create_app(
    service: Service,
    *,
    admin_token: str | None = None,
    admin_open: bool = True,
    manage_lifespan: bool = True,
) -> Starlette:
    """The app over `service`. Management routes need `admin_token` (Bearer) when one is set,
    and are closed when there is none and `admin_open` is false (a non-loopback bind);
    `manage_lifespan` starts and stops the service with the app."""

    def admin_allowed(request: Request) -> bool:
        if not admin_token:  # an empty token is no token: it would let "Bearer " in
            return admin_open
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given, f"Bearer {admin_token}")

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    routes: list[BaseRoute] = [
        *V2Api(service, admin_allowed).routes(),
        Route("/metrics", metrics),
    ]
    routes.extend(openai_routes(service))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if manage_lifespan:
            await service.start()
        try:
            yield
        finally:
            if manage_lifespan:
                await service.drain()

    return Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={404: http_error, 405: http_error}
    )

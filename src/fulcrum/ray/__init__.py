"""Fulcrum on a Ray Serve cluster: the same model repository, served by an ingress deployment
(Fulcrum's HTTP APIs) and one deployment per model whose replicas run Fulcrum's batcher and
backends. `serve run fulcrum.ray:app_builder repository=models`. Ray is imported only when an
application is built (the `fulcrum-serve[ray]` extra)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def app_builder(args: Mapping[str, object]) -> Any:
    """Ray Serve's application builder: `args` are `repository=...` and the options of
    `fulcrum.ray.app.AppArgs`; returns the `serve.Application`."""
    from fulcrum.extras import require

    require("ray", "ray.serve", feature="serving on a Ray Serve cluster")
    from fulcrum.ray.app import build_app

    return build_app(args)

"""The ingress's facade: the ordinary `Service` (so the same Starlette app, routes, context and
errors serve both), whose models are stubs and whose data calls go to each model's deployment
through a handle, bounded in time (`forward`). Metadata comes from the repository's configs,
read here without loading any weights."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulcrum.batcher import InferResult
from fulcrum.config import ModelConfig
from fulcrum.context import RequestContext
from fulcrum.errors import InvalidInput, NotFound
from fulcrum.protocol import InferRequest, validate_requested_outputs
from fulcrum.ray.aggregate import ReplicaSnapshot, merge_metrics, sum_statistics
from fulcrum.ray.forward import CallPolicy, forward
from fulcrum.ray.wire import to_wire
from fulcrum.repository import Servable
from fulcrum.service import Embeddings, Service, ServiceSettings
from fulcrum.service_run import serves_embeddings, with_variant
from fulcrum.service_stream import RowStream, open_row_stream

# Margin past the request's own deadline before the ingress gives up on the replica: the
# replica answers 504 itself at the deadline, and that answer should win.
DEADLINE_MARGIN_S = 1.0
REDEPLOY = "on Ray Serve a model changes by redeploying the application (serve deploy)"


@dataclass(frozen=True, slots=True)
class RemoteModel:
    """A model version served by its own deployment: what the repository holds at the ingress."""

    config: ModelConfig
    version: int
    variant: str

    @property
    def is_ready(self) -> bool:
        return True  # a replica that is not is replaced by Serve (its health check)

    async def stop(self) -> None:
        pass


class RayService(Service):
    """`Service` whose models run on their own Serve deployments (see the module docstring)."""

    def __init__(
        self,
        root: Path,
        handles: Mapping[str, Any],
        hub: Any,
        settings: ServiceSettings | None = None,
        call: CallPolicy | None = None,
        stats_timeout_s: float = 2.0,
    ) -> None:
        super().__init__(root, settings)
        self.handles = dict(handles)
        self.hub = hub
        self.call = call or CallPolicy()
        self.stats_timeout_s = stats_timeout_s

    async def _load_version(
        self, config: ModelConfig, version: int, version_dir: Path, variant: str
    ) -> Servable:
        if config.name not in self.handles:
            raise NotFound(f"model '{config.name}' has no deployment in this application")
        return RemoteModel(config, version, variant)

    def handle(self, name: str) -> Any:
        """The deployment handle of a served model (NotFound, as in process, when it is not)."""
        self._repository.get(name)
        return self.handles[name]

    def _deadline(self, ctx: RequestContext, own_timeout_s: float | None = None) -> float | None:
        left_s = ctx.timeout_s(own_timeout_s, time.monotonic())
        return None if left_s is None else left_s + DEADLINE_MARGIN_S

    # --- data calls ------------------------------------------------------------------------

    async def infer(
        self, ctx: RequestContext, name: str, version: int | None, request: InferRequest
    ) -> tuple[int, InferResult]:
        self._check_open()
        handle = self.handle(name)
        deadline = self._deadline(ctx, request.timeout_s)
        wire = to_wire(ctx, time.monotonic())
        answer: tuple[int, InferResult] = await forward(
            lambda: handle.infer.remote(wire, name, version, request),
            self.call, what=f"model '{name}'", deadline_s=deadline,
        )  # fmt: skip
        return answer

    async def infer_stream(
        self, ctx: RequestContext, name: str, version: int | None, request: InferRequest
    ) -> RowStream:
        """Rows answered in chunks: the chunks are cut here and each goes to a replica as its
        own request, so the chunks of one request spread over the replicas."""
        self._check_open()
        ctx = with_variant(ctx, request.parameters.get("variant"))
        config, served, _ = self._repository.get(name, version)
        validate_requested_outputs(config, request.outputs)

        async def run(inputs: Any) -> InferResult:
            chunk = dataclasses.replace(request, inputs=inputs)
            return (await self.infer(ctx, name, served, chunk))[1]

        return await open_row_stream(config, served, request, run)

    async def embed(
        self, ctx: RequestContext, name: str, texts: list[str], *, dimensions: int | None = None
    ) -> Embeddings:
        self._check_open()
        handle = self.handle(name)
        wire = to_wire(ctx, time.monotonic())
        embeddings: Embeddings = await forward(
            lambda: handle.embed.remote(wire, name, texts, dimensions),
            self.call, what=f"model '{name}'", deadline_s=self._deadline(ctx),
        )  # fmt: skip
        return embeddings

    def generative_models(self) -> list[dict[str, Any]]:
        cards: list[dict[str, Any]] = []
        for config, _, _ in self._repository.loaded():
            seen = any(card["id"] == config.name for card in cards)
            if not seen and (config.platform == "llm" or serves_embeddings(config)):
                cards.append({"id": config.name, "object": "model", "created": 0,
                              "owned_by": "fulcrum"})  # fmt: skip
        return cards

    def is_generative(self, name: str) -> bool:
        config, _, _ = self._repository.get(name)
        return config.platform == "llm"

    # --- figures of every replica ----------------------------------------------------------

    async def snapshots(self, model: str | None) -> list[ReplicaSnapshot]:
        snapshots: list[ReplicaSnapshot] = await forward(
            lambda: self.hub.collect.remote(model, self.stats_timeout_s),
            CallPolicy(timeout_s=self.stats_timeout_s + 5.0, retry_lost=True),
            what="statistics", deadline_s=None,
        )  # fmt: skip
        return snapshots

    async def statistics_of_replicas(
        self, ctx: RequestContext, name: str | None, version: int | None
    ) -> dict[str, Any]:
        """Triton's statistics, every replica's counters summed (see `aggregate`)."""
        if name is not None:
            self._repository.get(name, version)  # NotFound with the in-process message
        snapshots = await self.snapshots(name)
        rows = sum_statistics([s.rows for s in snapshots])
        chosen = [
            r for r in rows
            if (name is None or r["name"] == name)
            and (version is None or r["version"] == str(version))
        ]  # fmt: skip
        return {"model_stats": chosen}

    async def metrics_of_replicas(self) -> bytes:
        """Every replica's Prometheus text under a `replica` label (see `aggregate`)."""
        snapshots = await self.snapshots(None)
        return merge_metrics({s.replica: s.metrics_text for s in snapshots})

    # --- management: not in place on a cluster --------------------------------------------

    async def load(
        self, ctx: RequestContext, name: str, config_override: dict[str, object] | None = None
    ) -> None:
        raise InvalidInput(f"cannot load '{name}' here: {REDEPLOY}")

    async def unload(self, ctx: RequestContext, name: str) -> None:
        raise InvalidInput(f"cannot unload '{name}' here: {REDEPLOY}")

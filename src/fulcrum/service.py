"""The one facade the server calls: repository, batched models, LLM engines, metrics, health."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulcrum import __version__
from fulcrum.batcher import InferResult
from fulcrum.config import ModelConfig
from fulcrum.errors import InvalidInput, NotFound, Unavailable
from fulcrum.metrics import ServerMetrics
from fulcrum.protocol import (
    InferRequest,
    model_config_json,
    model_metadata,
    validate_inputs,
    validate_requested_outputs,
)
from fulcrum.repository import ModelRepository, Servable
from fulcrum.servable import BatchServable

if TYPE_CHECKING:
    from fulcrum.llm.engine import AsyncLLMEngine

log = logging.getLogger(__name__)

EXTENSIONS = ("binary_tensor_data", "model_repository", "statistics", "schedule_policy",
              "model_configuration")  # fmt: skip


@dataclass(frozen=True)
class ServiceSettings:
    """Server-wide limits and policies."""

    max_body_bytes: int = 64 * 1024 * 1024
    drain_timeout_s: float = 30.0
    load_models: tuple[str, ...] | None = None  # None: every model in the repository


class LLMServable:
    """Adapts an `AsyncLLMEngine` to the repository's `Servable`."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine

    @property
    def is_ready(self) -> bool:
        return bool(self.engine.is_healthy)

    async def stop(self) -> None:
        await self.engine.stop()


class Service:
    """Everything the HTTP layer needs, behind plain async methods."""

    def __init__(self, root: Path, settings: ServiceSettings | None = None) -> None:
        self.settings = settings or ServiceSettings()
        self.metrics = ServerMetrics()
        self.repository = ModelRepository(root, self._load_version)
        self._started = False
        self._stopping = False

    @classmethod
    def from_repository(cls, root: Path, settings: ServiceSettings | None = None) -> Service:
        return cls(Path(root), settings)

    async def start(self) -> None:
        """Load the repository's models; a model that fails is logged and stays unavailable."""
        names = self.settings.load_models
        if names is None:
            await self.repository.load_all()
        else:
            for name in names:
                await self.repository.load(name)
        self._started = True

    async def stop(self) -> None:
        """Turn readiness off, drain every model, release everything."""
        self._stopping = True
        await self.repository.close()

    def begin_shutdown(self) -> None:
        """Readiness off at once (SIGTERM); the drain follows."""
        self._stopping = True

    @property
    def is_live(self) -> bool:
        return True

    @property
    def is_ready(self) -> bool:
        return (
            self._started
            and not self._stopping
            and all(s.is_ready for _, _, s in self.repository.loaded())
        )

    def server_metadata(self) -> dict[str, object]:
        return {"name": "fulcrum", "version": __version__, "extensions": list(EXTENSIONS)}

    async def _load_version(self, config: ModelConfig, version: int, version_dir: Path) -> Servable:
        if config.platform == "llm":
            from fulcrum.llm.engine import AsyncLLMEngine

            engine = AsyncLLMEngine.from_config(config, version_dir, registry=self.metrics.registry)
            await engine.start()
            return LLMServable(engine)
        metrics = self.metrics.for_model(config.name, version)
        return await BatchServable.load(config, version, version_dir, metrics)

    def _check_open(self) -> None:
        if self._stopping:
            raise Unavailable("server is shutting down")

    def _batch_model(self, name: str, version: int | None) -> BatchServable:
        _, _, servable = self.repository.get(name, version)
        if not isinstance(servable, BatchServable):
            raise InvalidInput(f"model '{name}' is a generative model: use /v1/completions")
        return servable

    async def infer(
        self, name: str, version: int | None, request: InferRequest
    ) -> tuple[int, InferResult]:
        """Validate and run one request; returns the version that served it and its result."""
        self._check_open()
        servable = self._batch_model(name, version)
        validate_inputs(servable.config, request.inputs)
        validate_requested_outputs(servable.config, request.outputs)
        result = await servable.infer(
            request.inputs, priority=request.priority, timeout_s=request.timeout_s
        )
        return servable.version, result

    def model_metadata(self, name: str, version: int | None) -> dict[str, object]:
        config, _, _ = self.repository.get(name, version)
        entry_versions = [v for c, v, _ in self.repository.loaded() if c.name == name]
        return model_metadata(config, entry_versions if version is None else [version])

    def model_config(self, name: str) -> dict[str, object]:
        config, _, _ = self.repository.get(name)
        return model_config_json(config)

    def model_ready(self, name: str, version: int | None) -> bool:
        try:
            _, _, servable = self.repository.get(name, version)
        except NotFound:
            return False
        return not self._stopping and servable.is_ready

    def statistics(self, name: str | None, version: int | None) -> dict[str, Any]:
        """Triton's statistics response for one model, one version, or every model."""
        rows = [
            s.stats.to_json(c.name, v)
            for c, v, s in self.repository.loaded()
            if isinstance(s, BatchServable)
            and (name is None or c.name == name)
            and (version is None or v == version)
        ]
        if name is not None and not rows:
            self.repository.get(name, version)  # raises NotFound with the right message
        return {"model_stats": rows}

    def llm_engine(self, name: str) -> AsyncLLMEngine:
        """The engine serving a generative model (for the OpenAI routes)."""
        self._check_open()
        _, _, servable = self.repository.get(name)
        if not isinstance(servable, LLMServable):
            raise NotFound(f"model '{name}' is not a generative model")
        return servable.engine

    def llm_model_names(self) -> list[str]:
        return [c.name for c, _, s in self.repository.loaded() if isinstance(s, LLMServable)]

    async def drain(self) -> None:
        """Stop every model, bounded by the drain timeout."""
        try:
            await asyncio.wait_for(self.stop(), self.settings.drain_timeout_s)
        except TimeoutError:
            log.warning("drain timed out after %.0f s", self.settings.drain_timeout_s)

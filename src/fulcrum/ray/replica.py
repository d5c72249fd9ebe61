"""One replica of one model on Ray Serve: a normal in-process `Service` that loads only that model
(its batcher and backends, or its LLM engine), called by the ingress through a deployment handle.
It reports its autoscaling signals to Serve and its figures to the hub when asked."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from fulcrum.batcher import InferResult
from fulcrum.context import RequestContext
from fulcrum.errors import FulcrumError, Unavailable
from fulcrum.protocol import InferRequest
from fulcrum.ray.aggregate import ReplicaSnapshot
from fulcrum.ray.autoscale import Counters, Window, window_signals
from fulcrum.ray.rawhttp import RawRequest, run_asgi
from fulcrum.ray.wire import WireContext, from_wire
from fulcrum.servable import BatchServable
from fulcrum.server.app import create_app
from fulcrum.service import Embeddings, Service, ServiceSettings
from fulcrum.service_llm import LLMServable

log = logging.getLogger(__name__)
STATS_CONTEXT = RequestContext(request_id="ray-stats", tenant="default", api="management")
HUB_RETRY_S = 1.0  # the hub restarting (or not yet up): ask again after this
SERVE_LOGGER = "ray.serve"  # where Serve logs a replica call that raised, with its traceback


def quiet_expected_errors(record: logging.LogRecord) -> bool:
    """Drop Serve's traceback for a call that raised a 4xx or an overload answer (503, 504):
    they are outcomes, counted in Fulcrum's metrics; formatting a traceback for each shed
    request would cost more than the request under exactly the load that sheds."""
    error = record.exc_info[1] if record.exc_info else None
    return not (isinstance(error, FulcrumError) and error.status_code in EXPECTED_STATUSES)


EXPECTED_STATUSES = frozenset({400, 403, 404, 408, 413, 503, 504})


class ModelReplica:
    """The class a model's Serve deployment runs (see `fulcrum.ray.app`)."""

    # Serve awaits an async constructor: the model loads before the replica takes requests.
    async def __init__(  # type: ignore[misc]
        self, repository: str, model: str, hub: Any = None, revision: str = ""
    ) -> None:
        logging.getLogger(SERVE_LOGGER).addFilter(quiet_expected_errors)
        self.model = model
        self.revision = revision  # the model folder's digest (`app.folder_version`)
        self.replica = _replica_id()
        settings = ServiceSettings(load_models=(model,))
        self.service = Service.from_repository(Path(repository), settings)
        await self.service.start()
        if not self.service.is_ready:  # Serve retries a replica whose constructor raises
            raise Unavailable(f"model '{model}' failed to load on this replica")
        self.app = create_app(self.service, manage_lifespan=False)
        self._counters = Counters()
        self._reported_s = time.monotonic()
        self._hub = hub
        self._reporter = asyncio.ensure_future(self._report_loop()) if hub is not None else None

    # --- the ingress's calls -------------------------------------------------------------

    async def infer(
        self, wire: WireContext, name: str, version: int | None, request: InferRequest
    ) -> tuple[int, InferResult]:
        ctx = from_wire(wire, time.monotonic())
        return await self.service.infer(ctx, name, version, request)

    async def embed(
        self, wire: WireContext, name: str, texts: list[str], dimensions: int | None
    ) -> Embeddings:
        ctx = from_wire(wire, time.monotonic())
        return await self.service.embed(ctx, name, texts, dimensions=dimensions)

    async def http(self, request: RawRequest) -> AsyncIterator[object]:
        """An HTTP request run through this replica's own app (the OpenAI generation routes),
        streamed back: the response head first, then its body chunks as they are made."""
        async for item in run_asgi(self.app, request):
            yield item

    # --- health, figures and autoscaling ---------------------------------------------------

    # Async on purpose: Serve runs these on the replica's event loop, which owns the service.
    async def check_health(self) -> None:
        """Serve's health check: a replica whose model is not ready is replaced."""
        if not self.service.is_ready:
            raise Unavailable(f"model '{self.model}' is not ready on replica {self.replica}")

    def snapshot(self) -> ReplicaSnapshot:
        rows = self.service.statistics(STATS_CONTEXT, self.model, None)["model_stats"]
        text = generate_latest(self.service.metrics.registry).decode()
        return ReplicaSnapshot(self.replica, self.model, rows, text)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (see `fulcrum.ray.autoscale`)."""
        servables = self._servables()
        after = _counters(servables)
        predicted_s = max((_predicted_s(s) for s in servables), default=0.0)
        # An LLM's load is its sequences, running and waiting (vLLM's autoscaling signal).
        ongoing = sum(s.num_admitted for s in servables) + sum(
            s.engine.num_streams for _, _, s in self.service._repository.loaded()
            if isinstance(s, LLMServable)
        )  # fmt: skip
        now_s = time.monotonic()
        window = Window(
            elapsed_s=now_s - self._reported_s,
            num_instances=sum(s.config.instances.count for s in servables),
            num_queued=sum(s.queue_depth for s in servables),
            predicted_s=predicted_s, num_ongoing=ongoing,
        )  # fmt: skip
        signals = window_signals(self._counters, after, window)
        self._counters, self._reported_s = after, now_s
        return signals

    def _servables(self) -> list[BatchServable]:
        loaded = self.service._repository.loaded()  # this replica's own model only
        return [s for _, _, s in loaded if isinstance(s, BatchServable)]

    async def _report_loop(self) -> None:
        """Answer the hub's collections for as long as the replica lives (a long poll: the hub
        answers `poll` when a collection starts, or after a while with nothing to do)."""
        epoch = 0
        while True:
            try:
                asked = await self._hub.poll.remote(self.replica, self.model, epoch)
                if asked > epoch:
                    epoch = asked
                    await self._hub.answer.remote(epoch, self.snapshot())
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the hub restarting: keep serving, ask again later
                log.warning("stats hub unreachable from %s: %s", self.replica, exc)
                await asyncio.sleep(HUB_RETRY_S)

    async def __del__(self) -> None:  # Serve's graceful shutdown hook
        if self._reporter is not None:
            self._reporter.cancel()
            with contextlib.suppress(BaseException):
                await self._reporter
        await self.service.drain()


def _counters(servables: list[BatchServable]) -> Counters:
    num = request_ns = queue_ns = refused = compute_ns = 0
    for s in servables:
        num += s.stats.success.count
        request_ns += s.stats.success.ns
        queue_ns += s.stats.queue.ns
        refused += sum(s.stats.shed.values())
        compute_ns += sum(d.ns for d in s.stats.batches.values())  # each batch once
    return Counters(num, request_ns, queue_ns, refused, compute_ns)


def _predicted_s(servable: BatchServable) -> float:
    """The latency a new request would see: the batches queued ahead of it and its own, at the
    mean batch time so far (0 before the first batch)."""
    batches = servable.stats.batches.values()
    num_batches_run = sum(d.count for d in batches)
    if num_batches_run == 0:
        return 0.0
    batch_s = sum(d.ns for d in batches) / num_batches_run / 1e9
    rows_per_batch = max(1, servable.config.max_batch_size)
    num_batches = servable.queue_depth // rows_per_batch + 1
    return num_batches * batch_s / max(1, servable.config.instances.count)


def _replica_id() -> str:
    from ray import serve

    # The full id ("app#deployment#unique"): unique across models, and with Serve's prefix it
    # is the replica's actor name (what an operator, or a fault test, looks it up by).
    return str(serve.get_replica_context().replica_id.to_full_id_str())

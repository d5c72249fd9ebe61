"""AsyncLLMEngine: one model's admission and output streams on the event loop, over an engine
stepped elsewhere (`fulcrum.llm.engine_client`): a dedicated thread of the server, with
`engine_process = true` a process of its own, or with `num_engine_processes = N` N processes
(`fulcrum.llm.engine_group`). Tokens reach each request's asyncio queue with one
`call_soon_threadsafe` per step; a cancelled stream aborts its sequence within a step; a crashed
engine fails its requests clearly and is restarted by its supervisor (`fulcrum.llm.supervisor`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

from fulcrum.errors import FulcrumError, InvalidInput, ModelError, QueueFull, Unavailable
from fulcrum.llm.async_text import AsyncTextFront
from fulcrum.llm.engine_client import AddRequest, EngineClient
from fulcrum.llm.engine_front import EngineFront
from fulcrum.llm.metrics import LLMMetrics
from fulcrum.llm.outputs import RequestOutput
from fulcrum.llm.params import EngineParams
from fulcrum.llm.sampling_params import SamplingParams
from fulcrum.llm.supervisor import RestartPolicy, RestartTracker
from fulcrum.llm.sync_engine import LLMEngine

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from fulcrum.config import ModelConfig
    from fulcrum.llm.engine_group import EngineGroupClient
    from fulcrum.llm.engine_process import ProcessEngineClient

__all__ = ["AsyncLLMEngine", "LLMEngine"]

log = logging.getLogger(__name__)
_Item = RequestOutput | BaseException


class _OutputStream:
    """One request's outputs, handed from `on_step` to its stream (loop only): an asyncio.Queue
    without what a stream never uses (maxsize, putters, task counting). Every token of every
    request passes here; the Queue's bookkeeping was about 2 of the 6-7 us of CPU per token
    from put to the consumer's wake-up (256 streams, measured alone)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[_Item] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: _Item) -> None:
        self._items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():  # done: its reader was cancelled
            waiter.set_result(None)

    async def get(self) -> _Item:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._items.popleft()


class AsyncLLMEngine(AsyncTextFront):
    """One model's engine for the server: `generate` streams RequestOutputs."""

    def __init__(
        self,
        engine: EngineFront,
        *,
        model_name: str,
        version: int = 1,
        restart_policy: RestartPolicy | None = None,
        client: EngineClient | None = None,
    ) -> None:
        self.engine = engine  # the LLMEngine itself, or (process mode) its weightless front
        self.model_name = model_name
        self.version = version
        if client is None:
            from fulcrum.llm.engine_thread import ThreadEngineClient

            if not isinstance(engine, LLMEngine):
                raise TypeError("a thread-stepped AsyncLLMEngine needs an LLMEngine")
            client = ThreadEngineClient(engine, model_name)
        self._client = client
        self._started = False
        self._streams: dict[str, _OutputStream] = {}
        self._stopping = False
        self._accepting = False
        self._error: BaseException | None = None
        self._num_waiting = 0  # the scheduler's count, published by the engine's side
        # Python >= 3.10 binds an asyncio.Event to a loop on first use, not here, so this
        # constructor may run in a worker thread (from_config under asyncio.to_thread).
        self._idle = asyncio.Event()
        self._restarts = RestartTracker(restart_policy or RestartPolicy())
        self._restart_task: asyncio.Task[None] | None = None
        self._retry_after_s = 1.0  # the backoff left when the engine went down
        self._given_up = False  # too many restarts: down until the model is reloaded

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        version_dir: Path,
        *,
        version: int = 1,
        variant: str = "default",
        registry: CollectorRegistry | None = None,
    ) -> AsyncLLMEngine:
        """Build from a `platform = "llm"` model: parameters from config.toml, weights from disk
        (in process mode: the engine process loads them). Blocking (weights, KV pool, kernel
        compilation) and loop-free: call it in a worker thread; `start` then only starts
        stepping."""
        from prometheus_client import CollectorRegistry

        params = EngineParams.from_parameters(dict(config.parameters))
        metrics = LLMMetrics(registry or CollectorRegistry(), config.name, version, variant)
        try:
            if params.uses_process:
                client = _process_client(version_dir, params, config.name, metrics)
                return cls(client.front, model_name=config.name, version=version, client=client)
            engine = LLMEngine.from_checkpoint(version_dir, params, metrics=metrics)
        except BaseException:
            metrics.remove()  # a failed load leaves no series behind
            raise
        return cls(engine, model_name=config.name, version=version)

    @property
    def is_healthy(self) -> bool:
        """False before start, while a crashed engine waits for its restart, and for good once
        it crashed too often (readiness goes off)."""
        return self._started and self._client.is_alive and self._error is None

    @property
    def num_restarts(self) -> int:
        """Engine threads (or processes) restarted after a crash: the model's, and those of
        single engine processes of a group restarted while the others served."""
        num_single = getattr(self._client, "num_restarts", 0)
        return self._restarts.num_restarts + (num_single if isinstance(num_single, int) else 0)

    @property
    def num_streams(self) -> int:
        """Requests admitted whose output streams are still open."""
        return len(self._streams)

    @property
    def child_pids(self) -> tuple[int, ...]:
        """The engine processes' pids (`engine_process`, `num_engine_processes`; none for a
        thread): the memory budget counts their resident memory."""
        pids = getattr(self._client, "pids", None)
        if isinstance(pids, tuple):
            return pids
        pid = getattr(self._client, "pid", None)
        return (pid,) if isinstance(pid, int) else ()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def abort(self, request_id: str) -> None:
        """Abort an admitted request whose stream will never be read; unknown ids are ignored."""
        self._forget(request_id)
        self._client.submit(request_id)

    async def start(self) -> None:
        """Start stepping."""
        if self._started:
            return
        self._accepting = True
        self._idle.set()
        self._client.start(asyncio.get_running_loop(), self)
        self._started = True

    async def stop(self, timeout_s: float | None = None) -> None:
        """Refuse new requests, let in-flight ones finish (bounded), abort the rest, end the
        engine's thread or process, and drop this model version's metric series."""
        self._accepting = False
        await self._cancel_restart()
        drain_s = self.engine.params.drain_timeout_s if timeout_s is None else timeout_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), drain_s)
        self._fail_all(Unavailable(f"model {self.model_name!r} is shutting down"))
        self._stopping = True
        await asyncio.to_thread(self._client.stop, max(drain_s, 1.0))
        if self.engine.metrics is not None:
            self.engine.metrics.remove()

    def generate(
        self,
        prompt: str | list[int],
        sampling: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Admit a request now (raising InvalidInput, QueueFull, Shed or Unavailable at the call)
        and stream its outputs; closing or cancelling the iterator aborts the request."""
        request_id = request_id or uuid.uuid4().hex
        queue = self._admit(prompt, sampling, request_id, priority, cache_salt)
        return self._stream(request_id, queue)

    async def _stream(self, request_id: str, queue: _OutputStream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already forgot the request
                    raise item
                finished = item.finished
                yield item
        finally:
            self._forget(request_id)
            if not finished:  # cancelled or closed by the consumer: a client went away
                self._client.submit(request_id)

    def _admit(
        self,
        prompt: str | list[int],
        sampling: SamplingParams,
        request_id: str,
        priority: int,
        cache_salt: str | None,
    ) -> _OutputStream:
        if not self.is_healthy:
            raise self._down_error()
        if not self._accepting:
            raise Unavailable(f"model {self.model_name!r} is shutting down")
        if request_id in self._streams:
            raise InvalidInput(f"request id {request_id!r} is already in use")
        token_ids = self.engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
        # Validate here, before queueing, so a bad request fails alone and at once.
        self.engine.check_request(token_ids, sampling)
        num_pending, num_pending_tokens = self._client.pending()
        max_waiting = self.engine.params.max_num_waiting
        if self._num_waiting + num_pending >= max_waiting:
            if self.engine.metrics is not None:
                self.engine.metrics.request_shed("queue_full")
            raise QueueFull(f"model {self.model_name!r}: {max_waiting} requests already waiting")
        # Shed here, at the call, from the state the engine last published.
        self.engine.check_admission(len(token_ids), num_pending_tokens, num_pending)
        queue = _OutputStream()
        self._streams[request_id] = queue
        self._idle.clear()
        arrival_s = self.engine.clock.now()
        self._client.submit(
            AddRequest(request_id, token_ids, sampling, priority, cache_salt, arrival_s)
        )
        return queue

    # --- EngineSink: reports of the engine's side ------------------------------------------

    # A stream's queue leaves `_streams` with its last item: its iterator holds the queue, so
    # even an iterator that is never started cannot keep a finished request alive.

    def on_step(self, outputs: list[RequestOutput], errors: list[tuple[str, FulcrumError]]) -> None:
        """One step's outputs (on the loop: one call per step)."""
        for request_id, exc in errors:
            self._deliver_error(request_id, exc)
        for output in outputs:
            if output.error is not None:  # this request alone failed in its step
                self._deliver_error(output.request_id, output.error)
                continue
            queue = self._streams.get(output.request_id)
            if queue is not None:
                queue.put(output)
                if output.finished:
                    self._forget(output.request_id)

    def set_num_waiting(self, num_waiting: int) -> None:
        """Published from the engine's side (an int store: any thread)."""
        self._num_waiting = num_waiting

    def on_crash(self, exc: BaseException) -> None:
        """The engine died: fail its requests, then restart it after a backoff."""
        self._error = exc
        if self._client.crash_is_model_error:
            self._fail_all(
                ModelError(f"LLM engine crashed ({exc!r}); it is being restarted"), free=False
            )
        else:  # the process and every request in it are gone: 503, try again shortly
            metrics = self.engine.metrics
            if metrics is not None:  # the thread's reset counts them; a new process cannot
                for _ in self._streams:
                    metrics.request_finished("error")
            self._fail_all(Unavailable(f"{exc}; it is being restarted"), free=False)
        if self._stopping or not self._accepting:
            return
        backoff_s = self._restarts.on_crash(self.engine.clock.now())
        if backoff_s is None:
            log.error("LLM engine %r crashed too often; it stays down", self.model_name)
            self._given_up = True
            return
        self._retry_after_s = max(backoff_s, 1.0)
        # Owned here: stop() cancels it; it ends by restarting the engine or by giving up.
        self._restart_task = asyncio.get_running_loop().create_task(self._restart(backoff_s))

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put(exc)
            self._forget(request_id)

    def _fail_all(self, exc: FulcrumError, *, free: bool = True) -> None:
        for request_id in list(self._streams):
            self._deliver_error(request_id, exc)
            if free:  # the engine still runs: free the blocks
                self._client.submit(request_id)

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        if not self._streams:
            self._idle.set()

    # --- supervision (event loop) ---------------------------------------------------------

    async def _restart(self, backoff_s: float) -> None:
        await asyncio.sleep(backoff_s)  # the backoff deadline; nothing to wait on instead
        if self._stopping or not self._accepting:
            return
        try:  # a thread: a reset; a process: a new one, which loads the weights again
            await asyncio.to_thread(self._client.restart)
        except Exception as exc:  # the new process failed to load: a crash like any other
            log.exception("LLM engine %r failed to restart", self.model_name)
            self._restarts.on_restart(self.engine.clock.now())
            self.on_crash(exc)
            return
        if self._stopping or not self._accepting:
            return
        self._num_waiting = 0  # a fresh engine's queue is empty; it publishes anew
        self._error = None
        self._restarts.on_restart(self.engine.clock.now())
        if self.engine.metrics is not None:
            self.engine.metrics.restarts.inc()
        log.warning("LLM engine %r restarted (restart %d)", self.model_name, self.num_restarts)

    async def _cancel_restart(self) -> None:
        task, self._restart_task = self._restart_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _down_error(self) -> Unavailable:
        name = self.model_name
        if self._given_up:
            return Unavailable(
                f"model {name!r}: the LLM engine crashed repeatedly and stays down; reload it"
            )
        if self._error is not None:
            return Unavailable(
                f"model {name!r}: the LLM engine is restarting after a crash",
                retry_after_s=self._retry_after_s,
            )
        return Unavailable(f"model {name!r}: the LLM engine is not running")


def _process_client(
    version_dir: Path, params: EngineParams, model_name: str, metrics: LLMMetrics
) -> EngineGroupClient | ProcessEngineClient:
    """One engine process, or (num_engine_processes > 1) a group of them; blocking."""
    if params.num_engine_processes > 1:
        from fulcrum.llm.engine_group import EngineGroupClient

        return EngineGroupClient(version_dir, params, model_name, metrics)
    from fulcrum.llm.engine_process import ProcessEngineClient

    return ProcessEngineClient(version_dir, params, model_name, metrics)
